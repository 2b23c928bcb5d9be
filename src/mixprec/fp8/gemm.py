"""Which FP8 GEMM runs on this machine: chosen by measurement at first use, per shape class.

An FP8 product ``(a @ b) * inv_a * inv_b`` (``a`` (M, K), ``b`` (K, N), both FP8, fp32
accumulation) can be formed two ways:

- ``scaled_mm``: ``torch._scaled_mm``. On Hopper and Ada GPUs the FP8 tensor cores; on a CPU a
  oneDNN kernel whose speed depends on the machine: about 1.0-1.4x *slower* than emulation on
  an AVX2 EPYC, and 13-80x slower on a Xeon with AMX, where oneDNN falls back to its reference
  kernel for e4m3 x e4m3 (``ref:any`` under ``ONEDNN_VERBOSE``).
- ``emulate``: the FP8 operands decoded to fp32 (on the CPU by a 256-entry table lookup, 2-7x
  faster than torch's element-wise FP8 conversion there), an fp32 matmul, then the scales.
  The same quantised operands and the same fp32 accumulation, in another order.

So no path is assumed to be the faster one. The choice is made per *shape class*: the device,
tensorwise or rowwise scales, the output dtype, and M, K, N each rounded up to a power of two.

- CUDA: ``scaled_mm`` on compute capability 8.9 and newer (the FP8 tensor cores run several
  times fp32's rate, and nothing may be timed while a CUDA graph records), else ``emulate``.
- Other devices: at the first product of a class, both paths are timed on random FP8 operands
  of growing probe shapes (32, then 2x per dimension, up to the product's own shape, or until
  emulation takes `PROBE_MS`), in interleaved pairs. ``scaled_mm`` is chosen only where it
  takes at most `MARGIN` of emulation's time in every pair (a tie, or a machine too loaded to
  tell, goes to emulation: it is never the slower choice); a pair in which it takes `SLOWER`
  times emulation's time ends the measurement early (the reference kernel costs about 2 ms at
  the first probe shape). A few milliseconds per class, once per process.

After that a product costs one dictionary lookup: no timing, no host sync on the hot path.
Override: ``MIXPREC_FP8_GEMM=scaled_mm|emulate|auto`` in the environment (read at the first
decision), or `set_gemm_path` (``None``/``'auto'``: measure again). `gemm_choices` lists the
decisions with their timings; ``mixprec.explain`` and ``mixprec.fp8_report`` show the path each
FP8 layer's products took.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec._compat import scaled_mm_available
from mixprec.errors import PolicyError, format_options

__all__ = [
    "PATHS", "GemmChoice", "gemm_choices", "gemm_path", "layer_paths", "set_gemm_path",
    "shape_class", "summary", "use_path",
]  # fmt: skip

#: The ways to run an FP8 product.
PATHS = ("scaled_mm", "emulate")
#: The environment variable that forces a path (``'auto'``: measure).
ENV = "MIXPREC_FP8_GEMM"
#: Emulation time at which a probe is taken as representative of its class (ms).
PROBE_MS = 0.1
#: scaled_mm is chosen where it takes at most this fraction of emulation's time.
MARGIN = 0.85
#: A probe on which scaled_mm takes this many times emulation's time decides at once.
SLOWER = 3.0

_FIRST_PROBE = 32
_REPEATS = 3


@dataclass(frozen=True)
class GemmChoice:
    """The path one shape class runs, and why.

    Attributes:
        path: ``'scaled_mm'`` or ``'emulate'``.
        how: ``'measured'``, ``'override'`` (`set_gemm_path` or the environment),
            ``'device'`` (decided from the device: CUDA) or ``'unavailable'`` (this torch build
            cannot run ``_scaled_mm`` on the device).
        probe: (M, K, N) of the last probe timed (None when nothing was timed).
        scaled_mm_ms, emulate_ms: each path's best time on that probe.
    """

    path: str
    how: str
    probe: tuple[int, int, int] | None = None
    scaled_mm_ms: float | None = None
    emulate_ms: float | None = None

    def __str__(self) -> str:
        if self.probe is None:
            return f"{self.path} ({self.how})"
        m, k, n = self.probe
        return (f"{self.path} (measured at {m}x{k}x{n}: scaled_mm {self.scaled_mm_ms:.3f} ms, "
                f"emulate {self.emulate_ms:.3f} ms)")  # fmt: skip


ClassKey = tuple[str, int, bool, torch.dtype, int, int, int]

_CHOICES: dict[ClassKey, GemmChoice] = {}
_FORCED: list[str | None] = []  # [] until the environment was read; then [None or a path]


def _bucket(size: int) -> int:
    return max(16, 1 << max(0, int(size) - 1).bit_length())


def shape_class(device: torch.device, rowwise: bool, out_dtype: torch.dtype, m: int, k: int,
                n: int) -> ClassKey:  # fmt: skip
    """The key products share a decision under: sizes rounded up to powers of two (>= 16)."""
    return (device.type, device.index or 0, rowwise, out_dtype, _bucket(m), _bucket(k),
            _bucket(n))  # fmt: skip


def _check_path(path: str | None, where: str) -> str | None:
    if path is None or path == "auto":
        return None
    if path not in PATHS:
        raise PolicyError(
            f"{where}: {path!r} is not an FP8 GEMM path. Valid: "
            f"{format_options((*PATHS, 'auto'))} ('auto' measures both at first use and keeps "
            f"the faster)."
        )
    return path


def _forced() -> str | None:
    if not _FORCED:
        _FORCED.append(_check_path(os.environ.get(ENV, "auto").strip().lower() or None, ENV))
    return _FORCED[0]


def set_gemm_path(path: str | None) -> None:
    """Force every FP8 product of this process onto `path` (``'scaled_mm'``, ``'emulate'``), or
    measure again (``None`` or ``'auto'``: forgets the decisions made so far). A forced
    ``'scaled_mm'`` still emulates where this torch build cannot run ``_scaled_mm``."""
    checked = _check_path(path, "set_gemm_path")
    _FORCED[:] = [checked]
    _CHOICES.clear()


@contextlib.contextmanager
def use_path(path: str | None) -> Iterator[None]:
    """`set_gemm_path` for the duration of a ``with`` block; the decisions made before it are
    back afterwards (those made inside are dropped)."""
    checked = _check_path(path, "use_path")
    forced, choices = list(_FORCED), dict(_CHOICES)
    _FORCED[:] = [checked]
    _CHOICES.clear()
    try:
        yield
    finally:
        _FORCED[:] = forced
        _CHOICES.clear()
        _CHOICES.update(choices)


def gemm_choices() -> dict[ClassKey, GemmChoice]:
    """Every shape class decided so far in this process, with its `GemmChoice`."""
    return dict(_CHOICES)


def lookup(device: torch.device, rowwise: bool, out_dtype: torch.dtype, m: int, k: int,
           n: int) -> GemmChoice | None:  # fmt: skip
    """The decision for a product of these sizes, if one was made (nothing is measured)."""
    return _CHOICES.get(shape_class(device, rowwise, out_dtype, m, k, n))


def layer_paths(device: torch.device, rowwise: bool, tokens: int, in_features: int,
                out_features: int) -> dict[str, GemmChoice | None]:  # fmt: skip
    """The decisions an FP8 layer's three products ran under, for a batch of `tokens` rows:
    ``forward`` (tokens x in -> out), ``grad_input`` and ``grad_weight`` (None: not run)."""
    shapes = {"forward": (tokens, in_features, out_features),
              "grad_input": (tokens, out_features, in_features),
              "grad_weight": (out_features, tokens, in_features)}  # fmt: skip
    out: dict[str, GemmChoice | None] = {}
    for name, (m, k, n) in shapes.items():
        want = shape_class(device, rowwise, torch.float32, m, k, n)
        out[name] = next((c for key, c in _CHOICES.items()
                          if key[:3] == want[:3] and key[4:] == want[4:]), None)  # fmt: skip
    return out


def summary(paths: dict[str, GemmChoice | None]) -> str:
    """``'emulate'`` when the products that ran agree, else each product's path."""
    ran = {k: c.path for k, c in paths.items() if c is not None}
    names = set(ran.values())
    if len(names) > 1:
        return ", ".join(f"{k} {p}" for k, p in ran.items())
    if not names:
        return "not run"
    return names.pop() + ("" if len(ran) == len(paths) else " (backward not run yet)")


def gemm_path(a: torch.Tensor, b: torch.Tensor, rowwise: bool, out_dtype: torch.dtype) -> str:
    """The path for ``a @ b`` (FP8, (M, K) and (K, N)): decided once per shape class."""
    key = shape_class(a.device, rowwise, out_dtype, a.shape[0], a.shape[1], b.shape[1])
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _decide(a.device, rowwise, out_dtype, a.shape[0], a.shape[1],
                                         b.shape[1])  # fmt: skip
    return choice.path


def _decide(device: torch.device, rowwise: bool, out_dtype: torch.dtype, m: int, k: int,
            n: int) -> GemmChoice:  # fmt: skip
    if not scaled_mm_available(device):
        return GemmChoice("emulate", "unavailable")
    forced = _forced()
    if forced is not None:
        return GemmChoice(forced, "override")
    if device.type == "cuda":
        return GemmChoice("scaled_mm", "device")
    return _measure(device, rowwise, out_dtype, m, k, n)


# ------------------------------------------------------------------ the two paths


_LUTS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


#: Below this many elements torch's own conversion is as fast as the table (its overhead).
_LUT_MIN = 8192


def decode(q: torch.Tensor) -> torch.Tensor:
    """The fp32 values of FP8 `q` (exactly ``q.float()``; on the CPU by table lookup, 2-7x
    faster than torch's element-wise conversion there from 16k elements up)."""
    if q.device.type != "cpu" or q.numel() < _LUT_MIN:
        return q.float()
    if q.dim() == 2 and not q.is_contiguous() and q.t().is_contiguous():
        return decode(q.t()).t()  # a transposed operand: decode its storage order
    key = (q.dtype, q.device)
    lut = _LUTS.get(key)
    if lut is None:  # every FP8 bit pattern, NaNs included, and its fp32 value
        codes = torch.arange(256, dtype=torch.int32, device=q.device).to(torch.uint8)
        lut = _LUTS[key] = codes.view(q.dtype).float()
    index = q.contiguous().view(torch.uint8).reshape(-1).int()
    return lut.index_select(0, index).view(q.shape)


def emulated(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``(decode(a) @ decode(b)) * inv_a * inv_b`` in fp32, cast to `out_dtype`."""
    out = torch.mm(decode(a), decode(b)) * inv_a * inv_b
    return out.to(out_dtype)


def _pad_last(q: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero-pad the last dim of `q` to a multiple of `multiple` (as uint8: the bits of +0.0)."""
    extra = -q.shape[-1] % multiple
    if not extra:
        return q
    return F.pad(q.view(torch.uint8), (0, extra)).view(q.dtype)


def scaled(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
           out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:  # fmt: skip
    """``torch._scaled_mm`` with its layout rules met (see `mixprec.fp8.numerics.scaled_mm`)."""
    a = _pad_last(a.contiguous())
    b = _pad_last(b.t().contiguous()).t()
    if (inv_a.numel() > 1 or inv_b.numel() > 1) and not scaled_mm_available(a.device, True):
        # Per-tensor scales only (torch 2.11's CPU kernel): the FP8 product with unit scales,
        # in fp32, then the row and column scales, as the rowwise kernel applies them.
        one = torch.ones((), device=a.device)
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (out * inv_a * inv_b).to(out_dtype)
    return torch._scaled_mm(
        a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum
    )


# ------------------------------------------------------------------ measurement


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _measure(device: torch.device, rowwise: bool, out_dtype: torch.dtype, m: int, k: int,
             n: int) -> GemmChoice:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    side = _FIRST_PROBE
    while True:
        pm, pk, pn = min(m, side), min(k, side), min(n, side)
        a = torch.randn(pm, pk, generator=gen).to(device, torch.float8_e4m3fn)
        b = torch.randn(pn, pk, generator=gen).to(device, torch.float8_e4m3fn).t()
        if rowwise:
            inv_a, inv_b = torch.ones(pm, 1, device=device), torch.ones(1, pn, device=device)
        else:
            inv_a = inv_b = torch.ones((), device=device)

        def emu(a=a, b=b, inv_a=inv_a, inv_b=inv_b) -> torch.Tensor:
            return emulated(a, b, inv_a, inv_b, out_dtype)

        def smm(a=a, b=b, inv_a=inv_a, inv_b=inv_b) -> torch.Tensor:
            return scaled(a, b, inv_a, inv_b, out_dtype)

        try:  # warm-up (a new shape may build its kernel first)
            emu(), smm()
        except (RuntimeError, NotImplementedError, TypeError):  # a shape the kernel refuses
            return GemmChoice("emulate", "unavailable")
        # Interleaved pairs, so that load from other processes hits both paths alike; the
        # faster path must win every pair (a noisy machine then keeps emulation).
        pairs = []
        for _ in range(_REPEATS):
            pairs.append((_ms(smm), _ms(emu)))
            if pairs[0][0] > SLOWER * max(pairs[0][1], 0.02):  # clearly slower: decided
                break
        t_smm, t_emu = min(p[0] for p in pairs), min(p[1] for p in pairs)
        clearly_slower = t_smm > SLOWER * max(t_emu, 0.02)
        if clearly_slower or (pm, pk, pn) == (m, k, n) or t_emu >= PROBE_MS:
            faster = all(s <= MARGIN * e for s, e in pairs) and not clearly_slower
            path = "scaled_mm" if faster else "emulate"
            return GemmChoice(path, "measured", (pm, pk, pn), t_smm, t_emu)
        side *= 2
