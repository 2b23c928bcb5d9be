"""Loss scaling: the pure scale update, the sync-free GradScaler, its checkpoint format and the
skip-aware LR schedule."""

from mixprec.scaling.checkpoint import ScalerCheckpointError
from mixprec.scaling.scaler import GradScaler, ScalerStateError, SkipEvent
from mixprec.scaling.schedule import SkipAwareLR
from mixprec.scaling.skip import SkipMode
from mixprec.scaling.state import (
    ScaleConfig,
    ScalerConfigError,
    ScaleState,
    init_state,
    update_scale,
)
from mixprec.scaling.unscale import Fp16GradientError

__all__ = [
    "Fp16GradientError",
    "GradScaler",
    "ScaleConfig",
    "ScaleState",
    "ScalerCheckpointError",
    "ScalerConfigError",
    "ScalerStateError",
    "SkipAwareLR",
    "SkipEvent",
    "SkipMode",
    "init_state",
    "update_scale",
]
