"""FP8 numerics: amax, scales, saturating casts and the scaled matmul, as plain tensor functions.

Conventions (the ones ``torch._scaled_mm`` uses):

- a *scale* ``s`` multiplies a tensor before its cast: ``q = saturate(t * s).to(fp8)``, with
  ``s = fmax / amax`` so that the largest magnitude lands on the format's largest value;
- the matmul takes the *inverse* scales and applies them to the fp32 accumulator:
  ``out = (qa @ qb) * inv_a * inv_b``, so ``out`` approximates ``a @ b``;
- tensorwise scales are 0-dim fp32 tensors; rowwise ones are ``(rows, 1)`` for the left operand
  and ``(1, cols)`` for the right one.

Everything here is a tensor op: no value is read back to the host, so these functions can run
inside a captured CUDA graph. Costs per quantised operand: one read for the amax
(``vector_norm(t, inf)``, a single reduction) and one fused-by-nothing pass for scale, clamp and
cast in eager mode (three elementwise kernels; the GPU benchmark measures what that costs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec._compat import scaled_mm_available

__all__ = ["EPS", "amax", "dequantize", "inverse", "quantize", "scale_from_amax", "scaled_mm"]

#: Smallest amax a scale is computed from (an all-zero tensor gets a finite scale: 448e12).
EPS = 1e-12

_INF = float("inf")


def amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The largest magnitude of `t` (0-dim), or along `dim` (kept as a size-1 dim), in fp32.

    Inf when `t` holds an inf, NaN when it holds a NaN (so non-finite values are not hidden).
    """
    t = t.detach()
    if dim is None:
        return torch.linalg.vector_norm(t, _INF).float()
    return torch.linalg.vector_norm(t, _INF, dim=dim, keepdim=True).float()


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


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    """``clamp(t * scale, -fmax, fmax).to(dtype)`` computed in fp32: a saturating cast.

    The product is formed in fp32 (not in `t`'s dtype) so that the value is rounded once, by the
    cast to FP8, as the fp64 reference in the tests assumes. Saturation maps anything beyond
    +-fmax to +-fmax, so the cast never produces an inf; NaN stays NaN.
    """
    # One fp32 temporary, scaled and clamped in place (three passes, one allocation).
    q = t.to(torch.float32, copy=True)
    return q.mul_(scale).clamp_(-fmax, fmax).to(dtype)


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """The inverse scale ``torch._scaled_mm`` takes (exact for power-of-two scales)."""
    return scale.reciprocal()


def dequantize(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``q * inv`` in fp32: what a quantised operand stands for."""
    return q.float() * inv


def _pad_last(q: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero-pad the last dim of `q` to a multiple of `multiple` (as uint8: the bits of +0.0)."""
    extra = -q.shape[-1] % multiple
    if not extra:
        return q
    return F.pad(q.view(torch.uint8), (0, extra)).view(q.dtype)


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

    `a` may have any layout (it is made row-major), `b` is made column-major, as the FP8 GEMM of
    cuBLASLt requires (a contiguous copy where needed: FP8 tensors are half the bytes of bf16).
    The inner dimension is zero-padded to a multiple of 16 (zeros add nothing to a dot product),
    which the GPU kernel requires; M and N are a layer's token count and feature sizes, and only
    K = tokens (the weight-gradient product) is not a feature size.

    With ``emulate`` (or where ``torch._scaled_mm`` cannot run on the device), the product is
    formed as an fp32 matmul of the FP8 values, scaled afterwards: the same quantisation, with
    fp32 accumulation in another order.
    """
    if emulate or not scaled_mm_available(a.device):
        out = torch.mm(a.float(), b.float()) * inv_a * inv_b
        return out.to(out_dtype)
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
