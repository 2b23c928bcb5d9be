"""FP8 quantisation compiled into two kernels on CUDA: the amax, then scale and cast in one pass.

In eager mode the FP8 linear's custom ops quantise each operand in separate kernels: the amax,
an fp32 product, the cast (and a clamp under true delayed scaling), about 13 bytes moved per
bf16 element. On the first H100 run that made a whole ``Fp8Linear`` forward and backward 5-15x
slower than bf16's while its GEMMs ran 1.4-1.75x faster. Compiled by inductor, the same formula
is one reduction and one pointwise kernel: about 5 bytes per element. The custom ops stay opaque
to the compiler of the model (see `mixprec.fp8.ops`); only their insides are compiled.

The formula is `mixprec.fp8.ops`'s own function, traced, so the result is the eager one's:
every step is elementwise except the amax, a maximum, which is exact in any order (a test
compares the bits with inductor's CPU backend; the CUDA tests compare them on the GPU).

Which runs, per call: ``MIXPREC_FP8_QUANTIZE=auto|compiled|eager`` (read at the first call) or
`set_quantize_mode`. ``auto`` compiles on CUDA where Triton is present, and keeps eager mode
elsewhere (the CPU's FP8 products are emulated or oneDNN's; its compile is slow). Never compiled
while a CUDA graph records: a variant (input dtype, contiguity, recipe flags) first met there
runs eagerly, since compiling cannot happen inside a capture.

Costs: the first call of each variant compiles (seconds; inductor's cache on disk makes later
processes faster). Shapes are dynamic, so a new token count does not recompile. No host sync.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mixprec._compat import capturing
from mixprec.errors import PolicyError, format_options

__all__ = ["ENV", "MODES", "failures", "quantize_mode", "run", "set_quantize_mode", "use_compiled"]

#: The ways to quantise an operand.
MODES = ("auto", "compiled", "eager")
#: The environment variable that picks the mode (``auto`` when unset).
ENV = "MIXPREC_FP8_QUANTIZE"

_MODE: list[str] = []  # [] until the environment was read
_COMPILED: dict[tuple[Any, ...], Callable[..., Any]] = {}  # (fn, constants) -> compiled
_SEEN: set[tuple[Any, ...]] = set()  # variants compiled so far (safe to call while capturing)
_FAILED: dict[tuple[Any, ...], str] = {}  # variants that would not compile -> why


def _check(mode: str, where: str) -> str:
    if mode not in MODES:
        raise PolicyError(
            f"{where}={mode!r} is not an FP8 quantisation mode; valid: {format_options(MODES)} "
            f"(auto: compiled on CUDA with Triton, eager elsewhere)."
        )
    return mode


def quantize_mode() -> str:
    """The mode in force: `set_quantize_mode`'s, else the environment's, else ``'auto'``."""
    if not _MODE:
        _MODE.append(_check(os.environ.get(ENV, "auto").strip().lower() or "auto", ENV))
    return _MODE[0]


def set_quantize_mode(mode: str | None) -> None:
    """Force ``'compiled'`` or ``'eager'`` quantisation, or ``'auto'``/None (the default rule)."""
    _MODE[:] = [_check("auto" if mode is None else mode, "set_quantize_mode")]


@functools.cache
def _triton() -> bool:
    # Asked on every quantisation of a CUDA operand: a failed import is not cheap, so once.
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_compiled(t: Tensor) -> bool:
    """Whether `t`'s quantisation runs compiled under the current mode."""
    mode = quantize_mode()
    if mode == "eager":
        return False
    if mode == "compiled":
        return True
    return t.is_cuda and _triton()


def _variant(fn: Callable[..., Any], constants: tuple[Any, ...]) -> Callable[..., Any]:
    """`fn` compiled for one set of recipe constants: a copy of its code object of its own, so
    that each variant has its own dynamo cache (and recompile limit), not one shared by all."""
    compiled = _COMPILED.get((fn, constants))
    if compiled is None:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_COMPILED)}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                                  fn.__closure__)  # fmt: skip
        # Floats specialised: the recipe's (the format's maximum, the scale floor) are
        # constants of each variant. Left symbolic (dynamo's default), torch 2.11's inductor
        # failed on them (``tensorify_python_scalars``: every compiled quantisation fell back
        # to eager kernels on the H200 run). The patch costs about 3 us a call.
        compiled = torch._dynamo.config.patch(specialize_float=True)(
            torch.compile(copy, dynamic=True, fullgraph=True)
        )
        _COMPILED[(fn, constants)] = compiled
    return compiled


def run(fn: Callable[..., Any], t: Tensor, *args: Any) -> Any:
    """``fn(t, *args)``, compiled (dynamic shapes, one graph) or eager per `use_compiled`.

    `args` are the recipe's constants and scale tensors; each set of constants is one compiled
    variant. `t` is passed detached (an op's body needs no autograd): a parameter and an
    activation that requires grad are then the same variant.
    """
    if not use_compiled(t):
        return fn(t, *args)
    constants = tuple(a for a in args if not isinstance(a, Tensor))
    key = (fn, t.dtype, t.device.type, t.dim(), t.is_contiguous(), constants)
    if key in _FAILED or (key not in _SEEN and capturing()):
        # A first compile cannot happen inside a CUDA graph capture.
        return fn(t, *args)
    compiled = _variant(fn, constants)
    if key in _SEEN:
        return compiled(t.detach(), *args)
    try:  # the first call of a variant compiles it
        out = compiled(t.detach(), *args)
    except Exception as err:  # any compile failure: the eager kernels still work
        _FAILED[key] = f"{type(err).__name__}: {err}"[:300]
        warnings.warn(
            f"mixprec could not compile the FP8 quantisation of a {t.dtype} operand "
            f"({_FAILED[key]}); it runs as eager kernels instead (slower, same values). "
            f"Set {ENV}=eager to skip the attempt.",
            stacklevel=3,
        )
        return fn(t, *args)
    _SEEN.add(key)
    return out


def failures() -> dict[tuple[Any, ...], str]:
    """Variants whose compilation failed (they run eagerly), with the error."""
    return dict(_FAILED)
