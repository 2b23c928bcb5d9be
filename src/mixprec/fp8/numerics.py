"""FP8 numerics: amax, scales, saturating casts and the scaled matmul, as plain tensor functions.

Conventions (the ones ``torch._scaled_mm`` uses):

- a *scale* ``s`` multiplies a tensor before its cast: ``q = saturate(t * s).to(fp8)``, with
  ``s = fmax / amax`` so that the largest magnitude lands on the format's largest value;
- the matmul takes the *inverse* scales and applies them to the fp32 accumulator:
  ``out = (qa @ qb) * inv_a * inv_b``, so ``out`` approximates ``a @ b``;
- tensorwise scales are 0-dim fp32 tensors; rowwise ones are ``(rows, 1)`` for the left operand
  and ``(1, cols)`` for the right one.

Everything here is a tensor op: no value is read back to the host, so these functions can run
inside a captured CUDA graph. Costs per quantised operand: one read for the amax (a single
reduction: ``vector_norm(t, inf)`` on a GPU, ``aminmax`` on the CPU) and, in eager mode, an
fp32 product, a clamp (only where the scale may not fit the tensor: true delayed scaling) and
the cast: two or three elementwise kernels (the GPU benchmark measures what that costs). The
matmul's path is `mixprec.fp8.gemm`'s.
"""

from __future__ import annotations

import torch

from mixprec.fp8 import gemm

__all__ = [
    "EPS", "amax", "dequantize", "fp8_amax", "inverse", "quantize", "scale_from_amax",
    "scaled_mm",
]  # fmt: skip

#: Smallest amax a scale is computed from (an all-zero tensor gets a finite scale: 448e12).
EPS = 1e-12

_INF = float("inf")


def amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The largest magnitude of `t` (0-dim), or along `dim` (kept as a size-1 dim), in fp32.

    Inf when `t` holds an inf, NaN when it holds a NaN (so non-finite values are not hidden).
    """
    t = t.detach()
    if t.device.type == "cpu" and t.numel():
        # vector_norm(t, inf) is not vectorised on the CPU (about 20x slower than aminmax on an
        # AVX2 EPYC); max(hi, -lo) is the same value, NaN included (aminmax propagates NaN).
        lo, hi = torch.aminmax(t) if dim is None else torch.aminmax(t, dim=dim, keepdim=True)
        return torch.maximum(hi, -lo).float()
    if dim is None:
        return torch.linalg.vector_norm(t, _INF).float()
    return torch.linalg.vector_norm(t, _INF, dim=dim, keepdim=True).float()


def fp8_amax(q: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of FP8 `q` (0-dim fp32), read from its bytes: one reduction over
    1 byte per element (a bf16 source is 2, fp32 4). NaN if `q` holds a NaN.

    FP8 bytes are sign and magnitude: with the sign bit cleared, a larger byte is a larger
    magnitude, and NaN's code is above every finite one (e4m3fn has no inf; e5m2's inf cannot
    come out of a saturating cast).
    """
    code = q.view(torch.uint8).bitwise_and(0x7F).amax()
    return gemm.decode(code.view(1).view(q.dtype)).reshape(())


def scale_from_amax(
    amax_: torch.Tensor, fmax: float | torch.Tensor, power_of_two: bool = False
) -> torch.Tensor:
    """``fmax / amax`` (amax floored at `EPS`), optionally rounded down to a power of two.

    An inf amax gives scale 0 and a NaN amax a NaN scale: the quantised tensor is then NaN where
    the input was not finite, and the step's gradients carry the problem to the loss scaler,
    which skips the step (nothing is silently clipped away).
    """
    # A true division: fmax / (fmax * 2**-k) is exactly 2**k (a reciprocal times fmax is not).
    scale = fmax / torch.clamp(amax_, min=EPS)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(
    t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float, saturate: bool = True
) -> torch.Tensor:
    """``clamp(t * scale, -fmax, fmax).to(dtype)`` computed in fp32: a saturating cast.

    The product is formed in fp32 (not in `t`'s dtype) so that the value is rounded once, by the
    cast to FP8, as the fp64 reference in the tests assumes. Saturation maps anything beyond
    +-fmax to +-fmax, so the cast never produces an inf; NaN stays NaN.

    ``saturate=False`` skips the clamp, for a `scale` at most ``fmax / amax(t)`` (computed from
    `t`'s own amax, or smaller): then every ``|t * scale|`` is at most fmax times (1 + 2 ulp),
    which the cast rounds to fmax anyway, so the bits are the same with one pass less.
    """
    q = _fp32_product(t, scale, one_pass=not t.is_cpu and t.dim() > 0)
    if saturate:
        q.clamp_(-fmax, fmax)
    return q.to(dtype)


def _fp32_product(t: torch.Tensor, scale: torch.Tensor, one_pass: bool) -> torch.Tensor:
    """``t * scale`` as a new fp32 tensor, rounded once (`t` converted exactly first)."""
    if one_pass:
        # A 1-element scale with a dimension (not 0-dim) takes part in type promotion: a GPU
        # kernel reads `t` as it is and writes the fp32 product, in one pass (no fp32 copy).
        return t * (scale.reshape(1) if scale.dim() == 0 else scale)
    # The CPU's elementwise kernels take one dtype: a mixed-dtype product would copy `t` to
    # fp32 first anyway, plus a second fp32 buffer for the result.
    return t.to(torch.float32, copy=True).mul_(scale)


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """The inverse scale ``torch._scaled_mm`` takes (exact for power-of-two scales)."""
    return scale.reciprocal()


def dequantize(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``q * inv`` in fp32: what a quantised operand stands for."""
    return q.float() * inv


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool = False,
    emulate: bool = False,
) -> torch.Tensor:
    """``(a @ b) * inv_a * inv_b`` for FP8 `a` (M, K) and `b` (K, N), accumulated in fp32.

    For ``torch._scaled_mm``, `a` is made row-major and `b` column-major, as the FP8 GEMM of
    cuBLASLt requires (a contiguous copy where needed: FP8 tensors are half the bytes of bf16),
    and the inner dimension is zero-padded to a multiple of 16 (zeros add nothing to a dot
    product); M and N are a layer's token count and feature sizes, and only K = tokens (the
    weight-gradient product) is not a feature size.

    Which path runs is `mixprec.fp8.gemm`'s choice for the product's shape class: the faster
    of ``_scaled_mm`` and emulation on this machine, measured at first use (CUDA: ``_scaled_mm``
    from compute capability 8.9). With ``emulate`` (or where ``_scaled_mm`` cannot run on the
    device) the product is an fp32 matmul of the FP8 values, scaled afterwards: the same
    quantisation, with fp32 accumulation in another order.
    """
    rowwise = inv_a.numel() > 1 or inv_b.numel() > 1
    if emulate or gemm.gemm_path(a, b, rowwise, out_dtype) == "emulate":
        return gemm.emulated(a, b, inv_a, inv_b, out_dtype)
    return gemm.scaled(a, b, inv_a, inv_b, out_dtype, fast_accum)
