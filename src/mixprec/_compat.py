"""torch-version and import-cost shims, in one place.

Supported: torch 2.11 through 2.13 and newer, Python 3.10+.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "autocast_state_traceable",
    "capturing",
    "cuda_lacks_bf16",
    "dynamo_tracing",
    "local_tensor",
    "mark_constant_result",
    "scaled_mm_available",
]

F = TypeVar("F", bound=Callable[..., Any])

# The attribute torch.compiler.assume_constant_result sets (torch 2.4 - 2.13). Setting it here
# avoids importing torch._dynamo (about 1.4 s) when mixprec is imported; a test checks that
# torch's own decorator still sets exactly this attribute.
_DYNAMO_CONSTANT_ATTR = "_dynamo_marked_constant"


def mark_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result`` without importing the compiler stack."""
    setattr(fn, _DYNAMO_CONSTANT_ATTR, True)
    return fn


def capturing() -> bool:
    """Whether the current CUDA stream is recording a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


#: True only while dynamo traces Python (not while a backend or AOTAutograd runs real Python,
#: where ``torch.compiler.is_compiling()`` is also true). mixprec's graph path re-runs a
#: captured graph through the eager engine inside a backend, where the engine must behave
#: exactly as in eager.
dynamo_tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


_TRACEABLE: list[bool] = []


@mark_constant_result  # dynamo calls it once per trace and bakes the answer in
def autocast_state_traceable() -> bool:
    """Whether dynamo traces torch's autocast state setters (``torch.set_autocast_enabled``,
    ``torch.autocast_increment_nesting``, ...) into the graph: torch 2.13 does; torch 2.11
    treats them as skipped builtins (a graph break, an error under ``fullgraph=True``). Ask only
    while dynamo traces (it imports ``torch._dynamo``)."""
    if not _TRACEABLE:
        from torch._dynamo import trace_rules

        rule = trace_rules.manual_torch_name_rule_map.get("torch._C.set_autocast_enabled")
        _TRACEABLE.append(rule is None or "Skip" not in getattr(rule, "__name__", ""))
    return _TRACEABLE[0]


@mark_constant_result  # dynamo (2.11) cannot trace torch.cuda.is_bf16_supported: a graph break
def cuda_lacks_bf16() -> bool:
    """Whether this process has a CUDA device without bf16 support (pre-Ampere). Constant for
    the process, so a region opened inside compiled code asks at trace time only."""
    return torch.cuda.is_available() and not torch.cuda.is_bf16_supported()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage); any other tensor as it is.

    In-place ops on the result change the DTensor. Nothing is communicated: the caller agrees
    across ranks itself (the scaler all-reduces its overflow count once, asynchronously), where
    DTensor's own dispatch would run a blocking collective per op. No DTensor can exist before
    ``torch.distributed.tensor`` is imported, so this does not import it (about 1.5 s).
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        with torch.no_grad():  # to_local() then returns the local tensor itself, not a view
            return tensor.to_local()
    return tensor


_SCALED_MM: dict[tuple[str, int | None, bool], bool] = {}


def scaled_mm_available(device: torch.device, rowwise: bool = False) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 operands on `device` (cached per device), with one
    scale per row of `a` and per column of `b` when `rowwise`.

    CUDA: compute capability 8.9 (Ada) or newer, decided from the capability alone so that no
    kernel runs (this may be asked while a CUDA graph records). Other devices: one tiny
    ``_scaled_mm`` is tried the first time (torch 2.13 runs both forms on the CPU; torch 2.11
    only per-tensor scales). Where it is unavailable, mixprec's FP8 matmuls are emulated (same
    quantisation, fp32 matmul) or, for rowwise scales only, scaled after the FP8 product.
    """
    key = (device.type, device.index, rowwise)
    known = _SCALED_MM.get(key)
    if known is not None:
        return known
    ok = hasattr(torch, "_scaled_mm")
    if ok and device.type == "cuda":
        ok = torch.cuda.get_device_capability(device) >= (8, 9)
    elif ok:
        try:
            a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
            shape = (16, 1) if rowwise else ()
            one = torch.ones(shape, device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
    _SCALED_MM[key] = ok
    return ok
