"""The eager engine: a torch function mode that applies a policy to each call, above autograd."""

from mixprec.eager.autocast import (
    autocast,
    get_autocast_dtype,
    get_autocast_policy,
    is_autocast_enabled,
)
from mixprec.eager.custom import (
    checkpoint_context,
    custom_bwd,
    custom_fwd,
    float_function,
    half_function,
    promote_function,
)

__all__ = [
    "autocast",
    "checkpoint_context",
    "custom_bwd",
    "custom_fwd",
    "float_function",
    "get_autocast_dtype",
    "get_autocast_policy",
    "half_function",
    "is_autocast_enabled",
    "promote_function",
]
