"""Dtype and device-type vocabulary: names, parsing, per-device defaults and their reasons.

The tables here are the single source of the names mixprec accepts, so error messages list
exactly what would have worked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mixprec._compat import cuda_lacks_bf16
from mixprec.errors import (
    AutocastError,
    DeviceTypeError,
    PolicyError,
    format_options,
    unknown_value,
)

__all__ = [
    "DEVICE_TYPES",
    "LOW_DTYPES",
    "DtypeChoice",
    "default_dtype",
    "dtype_name",
    "parse_device_type",
    "parse_dtype",
    "resolve_dtype",
]

# Name -> dtype. Short forms first: `dtype_name` reports the first name of each dtype.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "f16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "f32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}

#: The low-precision dtypes an autocast region can compute in.
LOW_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

#: Device types with an op table, and the default low dtype of each with the reason for it.
_DEVICE_DEFAULTS: dict[str, tuple[torch.dtype, str]] = {
    "cuda": (
        torch.float16,
        "CUDA default: fp16 runs on the tensor cores of every CUDA GPU since Volta (bf16 needs "
        "Ampere or newer) and keeps 3 more mantissa bits; fp16 needs loss scaling",
    ),
    "cpu": (
        torch.bfloat16,
        "CPU default: bf16 has fast kernels on CPUs with AVX512-BF16/AMX, while fp16 matmuls are "
        "emulated on most CPUs (about 100x slower than bf16)",
    ),
    "xpu": (torch.float16, "XPU default: fp16, as torch.autocast uses on XPU"),
    "mps": (torch.float16, "MPS default: fp16, as torch.autocast uses on Apple GPUs"),
}

# Names people use for a device type that torch spells otherwise (suggested, never accepted).
_DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "rocm": "cuda", "hip": "cuda", "apple": "mps"}

#: Device types mixprec.autocast accepts.
DEVICE_TYPES: tuple[str, ...] = tuple(_DEVICE_DEFAULTS)


class DtypeChoice(NamedTuple):
    """A resolved compute dtype and the reason it was chosen."""

    dtype: torch.dtype
    reason: str


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of `dtype` (``torch.bfloat16`` -> ``'bf16'``)."""
    for name, value in _DTYPE_NAMES.items():
        if value is dtype:
            return name
    return str(dtype).removeprefix("torch.")


_FP8_WORDS = ("fp8", "float8", "e4m3", "e5m2")
# mixprec.fp8.recipe.RECIPES (a test checks they agree); the core does not import fp8/
_FP8_RECIPES = ("tensorwise", "delayed", "rowwise")


def _fp8_is_not_a_dtype(name: str) -> str:
    """Where FP8 goes instead of a compute dtype: a per-layer rule and a recipe."""
    return (
        f"{name!r} is not a compute dtype: FP8 is chosen per linear layer, not per op, by FP8 "
        f"rules in the policy, with scales kept per layer. Keep a 16-bit compute dtype and add "
        f"the rule: Policy(compute='bf16').fp8('auto') (string form 'compute=bf16,fp8=auto'), "
        f"and pick a recipe where the layers are converted: mixprec.initialize(model, "
        f"optimizer, 'O2', dtype='bf16', fp8='tensorwise') or mixprec.to_fp8(model, "
        f"'tensorwise'). Recipes: {format_options(_FP8_RECIPES)}. See docs/fp8.md."
    )


def parse_dtype(value: str | torch.dtype, *, low_only: bool = False) -> torch.dtype:
    """Turn ``'bf16'``, ``'float16'``, ``torch.half`` ... into a `torch.dtype`.

    Args:
        value: a dtype or one of its names (``bf16``, ``bfloat16``, ``fp16``, ``half``, ...).
        low_only: accept only the low-precision dtypes an autocast region can compute in.

    Raises:
        PolicyError: the name is unknown, or (with `low_only`) not a low-precision dtype.
    """
    if isinstance(value, torch.dtype):
        dtype = value
        if low_only and "float8" in str(dtype):
            raise PolicyError(_fp8_is_not_a_dtype(str(dtype)))
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            if any(word in key for word in _FP8_WORDS):
                raise PolicyError(_fp8_is_not_a_dtype(value))
            raise PolicyError(unknown_value("dtype", value, _DTYPE_NAMES))
        dtype = _DTYPE_NAMES[key]
    else:
        raise PolicyError(
            f"dtype must be a torch.dtype or a name such as 'bf16', got {type(value).__name__} "
            f"{value!r}."
        )
    if low_only and dtype not in LOW_DTYPES:
        names = [dtype_name(d) for d in LOW_DTYPES]
        raise PolicyError(
            f"the compute dtype must be 16-bit, got {dtype_name(dtype)!r}. Valid compute "
            f"dtypes: {format_options(names)}. To keep work in fp32, disable the region "
            f"(autocast(..., enabled=False)) or move ops in the policy "
            f"(Policy().move('softmax', to='fp32'))."
        )
    return dtype


def parse_device_type(device_type: str | torch.device) -> str:
    """Normalise ``'cuda:0'`` / ``torch.device('cuda')`` to ``'cuda'``; reject unknown types.

    A ``torch.device`` is accepted here although ``torch.autocast`` takes only strings: a region
    covers every device of its type, so the device's index is dropped.

    Raises:
        DeviceTypeError: an unknown device type (a PolicyError, and a RuntimeError as torch's).
        PolicyError: neither a string nor a ``torch.device`` (a ValueError, as torch's).
    """
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if not isinstance(device_type, str):
        raise PolicyError(
            f"device_type must be a string such as 'cuda' or 'cpu', got "
            f"{type(device_type).__name__} {device_type!r}."
        )
    name = device_type.split(":", 1)[0].strip().lower()
    if name not in _DEVICE_DEFAULTS:
        raise DeviceTypeError(
            unknown_value(
                "device type",
                device_type,
                DEVICE_TYPES,
                hint="NVIDIA and AMD GPUs are 'cuda', Intel GPUs 'xpu', Apple GPUs 'mps'.",
                aliases=_DEVICE_ALIASES,
            )
        )
    return name


def default_dtype(device_type: str) -> DtypeChoice:
    """The default low dtype of `device_type`, with the reason for it."""
    dtype, reason = _DEVICE_DEFAULTS[parse_device_type(device_type)]
    return DtypeChoice(dtype, reason)


def resolve_dtype(
    device_type: str, dtype: str | torch.dtype | None, policy_dtype: torch.dtype | None = None
) -> DtypeChoice:
    """Pick the compute dtype of a region: explicit `dtype`, else the policy's, else the default.

    Raises:
        PolicyError: the dtype is unknown or not 16-bit.
        AutocastError: bf16 requested on a CUDA GPU that has no bf16 support.
    """
    device_type = parse_device_type(device_type)
    if dtype is not None:
        choice = DtypeChoice(parse_dtype(dtype, low_only=True), "requested by the dtype argument")
    elif policy_dtype is not None:
        choice = DtypeChoice(parse_dtype(policy_dtype, low_only=True), "set by the policy")
    else:
        choice = default_dtype(device_type)
    if device_type == "cuda" and choice.dtype is torch.bfloat16 and cuda_lacks_bf16():
        name = torch.cuda.get_device_name()
        raise AutocastError(
            f"bf16 was requested on CUDA, but {name} has no bf16 support (it needs compute "
            f"capability 8.0, Ampere, or newer). Use dtype='fp16' with a GradScaler, or run on "
            f"a GPU with bf16. Valid dtypes here: {format_options(['fp16'])}."
        )
    return choice
