"""mixprec: automatic mixed-precision training for PyTorch.

The public API is what this module exports; everything in submodules whose names are not listed
here may change without notice.
"""

from mixprec._version import __version__
from mixprec.cpu_memory import CpuMemory, keep_cpu_memory
from mixprec.diagnostics import (
    AmpMetrics,
    ExplainReport,
    NonFiniteEvent,
    ScaleHistory,
    UnderflowReport,
    explain,
    grad_underflow,
    scale_history,
    watch_nonfinite,
)
from mixprec.distributed import DistributedError, fully_shard, load_checkpoint, save_checkpoint
from mixprec.dtypes import default_dtype
from mixprec.eager import (
    autocast,
    checkpoint_context,
    custom_bwd,
    custom_fwd,
    float_function,
    get_autocast_dtype,
    get_autocast_policy,
    half_function,
    is_autocast_enabled,
    promote_function,
)
from mixprec.errors import AutocastError, BannedOpError, MixprecError, PolicyError
from mixprec.fp8 import Fp8Recipe, Fp8Report, fp8_report, fp8_update, to_fp8
from mixprec.graph import AmpBackend, CastReport, compile
from mixprec.heal import HealConfig
from mixprec.heal.online import Healer, HealMove
from mixprec.heal.tune import TuneReport, tune_policy
from mixprec.levels import (
    AmpOptimizer,
    OptLevel,
    describe,
    initialize,
    master_params,
    scale_loss,
)
from mixprec.optim import LowMemAdam, LowMemAdamW, LowMemSGD, MemoryReport, memory_report
from mixprec.policy import Decision, OpCategory, Policy
from mixprec.scaling import (
    GradScaler,
    ScaleConfig,
    ScalerCheckpointError,
    ScalerConfigError,
    ScalerStateError,
    SkipAwareLR,
    update_scale,
)
from mixprec.step import TrainStep, TrainStepError

__all__ = [
    "AmpBackend",
    "AmpMetrics",
    "AmpOptimizer",
    "AutocastError",
    "BannedOpError",
    "CastReport",
    "CpuMemory",
    "Decision",
    "DistributedError",
    "ExplainReport",
    "Fp8Recipe",
    "Fp8Report",
    "GradScaler",
    "HealConfig",
    "HealMove",
    "Healer",
    "LowMemAdam",
    "LowMemAdamW",
    "LowMemSGD",
    "MemoryReport",
    "MixprecError",
    "NonFiniteEvent",
    "OpCategory",
    "OptLevel",
    "Policy",
    "PolicyError",
    "ScaleConfig",
    "ScaleHistory",
    "ScalerCheckpointError",
    "ScalerConfigError",
    "ScalerStateError",
    "SkipAwareLR",
    "TrainStep",
    "TrainStepError",
    "TuneReport",
    "UnderflowReport",
    "__version__",
    "autocast",
    "checkpoint_context",
    "compile",
    "custom_bwd",
    "custom_fwd",
    "default_dtype",
    "describe",
    "explain",
    "float_function",
    "fp8_report",
    "fp8_update",
    "fully_shard",
    "get_autocast_dtype",
    "get_autocast_policy",
    "grad_underflow",
    "half_function",
    "initialize",
    "is_autocast_enabled",
    "keep_cpu_memory",
    "load_checkpoint",
    "master_params",
    "memory_report",
    "promote_function",
    "save_checkpoint",
    "scale_history",
    "scale_loss",
    "to_fp8",
    "tune_policy",
    "update_scale",
    "watch_nonfinite",
]
