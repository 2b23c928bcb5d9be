"""The FP8 linear as two torch custom ops, ``mixprec::fp8_linear`` and its backward.

Why custom ops (and not an ``autograd.Function`` of plain torch calls): an op is one opaque node
for every consumer of the call. ``torch.compile`` (any backend), `mixprec.compile`'s re-trace
through the eager engine, the kernel-replay test backend and a CUDA-graph capture all see the
same ``mixprec::fp8_linear`` call, and mixprec's autocast engine passes it through (no table
names it); its body runs with torch's autocast and function modes off, so nothing re-casts what
it quantises. The backward op records the output gradient's amax into the layer's ``fp8_bwd``
buffer, a declared mutation that AOTAutograd replays in the compiled backward. The price: a
compiler cannot fuse the quantisation into neighbouring kernels (see the GPU benchmark).

Forward, per operand ``t`` with format max ``fmax``:

    amax  = max|t|                                   (rowwise: per row along the reduction dim)
    scale = fmax / amax                              (dynamic), or
            min(delayed, fmax / amax)                (delayed, overflow='rescale')
    q     = clamp(t * scale, -fmax, fmax).to(fp8)

or, true delayed scaling (delayed, overflow='saturate'; `Fp8Linear` passes the scales
`fp8_update` prepared, and the flag ``delayed`` False until there are some):

    q     = clamp(t * delayed, -fmax, fmax).to(fp8)   (no pass over t before the cast)
    amax  = max|q| / delayed, read from the FP8 bytes; 2 fmax / delayed if q reached fmax

and ``out = q_x @ q_w.T * (1/scale_x) * (1/scale_w)`` (`mixprec.fp8.gemm` picks
``torch._scaled_mm`` or emulation for it). A weight already quantised (``wq``: cached across
micro-batches, or all-gathered in FP8 by FSDP2) is used as it is. Backward quantises the output
gradient the same way (e5m2 or e4m3) and forms ``grad_input = g @ w`` and ``grad_weight = g.T @
x`` from the forward's quantised operands (tensorwise: they are saved in FP8, half the bytes of
bf16) or re-quantised along the other axis (rowwise: the inputs are saved in their own dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from mixprec.fp8 import fused
from mixprec.fp8.numerics import amax, fp8_amax, inverse, quantize, scale_from_amax, scaled_mm
from mixprec.fp8.recipe import E4M3, E5M2, fp8_max

__all__ = ["fp8_linear", "fp8_linear_backward", "fp8_record"]

_E4M3_MAX = fp8_max(E4M3)


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    # The body computes exactly what it says: no autocast list and no function mode (mixprec's
    # engine, a user's) may re-cast the quantised operands or the fp32 accumulations.
    with torch._C.DisableTorchFunction(), torch._C._DisableAutocast():
        yield


def _scale(t_amax: Tensor, delayed: Tensor, fmax: float, flags: tuple[bool, bool, bool]) -> Tensor:
    """The scale an operand is quantised with (see the module docstring)."""
    is_delayed, _, power_of_two = flags
    current = scale_from_amax(t_amax, fmax, power_of_two)
    if not is_delayed:
        return current
    return torch.minimum(delayed, current)


def _quantize(t: Tensor, dim: int | None, delayed: Tensor, fmax: float, dtype: torch.dtype,
              flags: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(q, inverse scale, tensor amax, tensor-level scale) of `t` (rowwise when `dim` is set)."""
    if dim is None:
        if flags[0] and flags[1]:
            # True delayed scaling: the cast takes the delayed scale as it is, without a pass
            # over `t` for its current amax first. The amax the history needs is read from the
            # FP8 bytes afterwards (one byte per element); where the cast saturated (or just
            # reached fmax) the true amax is unknown, at least fmax / scale, and twice that is
            # recorded, so the scale halves each step until the operand fits.
            scale = delayed
            q = quantize(t, scale, dtype, fmax)
            found = fp8_amax(q)
            t_amax = torch.where(found >= fmax, 2.0 * fmax, found) / scale
            return q, inverse(scale), t_amax, scale
        t_amax = amax(t)
        scale = _scale(t_amax, delayed, fmax, flags)
        # A scale from t's own amax (or below it) fits t: no clamp needed (see `quantize`).
        return quantize(t, scale, dtype, fmax, False), inverse(scale), t_amax, scale
    rows = amax(t, dim=dim)
    scale = scale_from_amax(rows, fmax, flags[2])
    t_amax = rows.amax()
    return quantize(t, scale, dtype, fmax, False), inverse(scale), t_amax, scale.amin()


def _q(t: Tensor, *args: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # `_quantize`, compiled into two kernels where `mixprec.fp8.fused` says so.
    return fused.run(_quantize, t, *args)


@torch.library.custom_op("mixprec::fp8_linear", mutates_args=())
def fp8_linear(
    x: Tensor,
    w: Tensor,
    scales: Tensor,
    grad_stats: Tensor,
    out_dtype: torch.dtype,
    grad_e5m2: bool,
    rowwise: bool,
    delayed: bool,
    saturate: bool,
    power_of_two: bool,
    fast_accum: bool,
    emulate: bool,
    wq: Tensor | None = None,
    wq_inv: Tensor | None = None,
    wq_stats: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``x @ w.T`` in FP8: (out, q_x, inv_x, q_w, inv_w, stats). `x` is (M, K), `w` (N, K).

    `scales` (3,) are the delayed scales (input, weight, grad); `stats` (4,) returns the amax
    and the (tensor-level) scale used for the input and the weight. `grad_stats` and
    `grad_e5m2` are for the backward (which writes the output gradient's amax into
    `grad_stats`); the forward only reads its arguments.

    `wq`, `wq_inv`, `wq_stats` (tensorwise only): the weight already quantised, as an FP8 tensor
    like `w`, its inverse scale, and the `stats` of the forward that quantised it (its amax and
    scale are entries 1 and 3), from `Fp8Linear`'s cache (the micro-batches of one optimizer
    step) or from FSDP2's FP8 all-gather; `w` is then not read, and `q_w` comes back empty (an
    op's outputs may not alias its inputs: the caller keeps `wq`).
    """
    flags = (delayed, saturate, power_of_two)
    with _plain():
        dim = 1 if rowwise else None
        qx, inv_x, ax, sx = _q(x, dim, scales[0], _E4M3_MAX, E4M3, flags)
        if wq is None:
            qw, inv_w, aw, sw = _q(w, dim, scales[1], _E4M3_MAX, E4M3, flags)
            gemm_w, kept = qw, qw
        else:
            assert wq_inv is not None and wq_stats is not None
            inv_w, aw, sw = wq_inv.clone(), wq_stats[1], wq_stats[3]
            gemm_w, kept = wq, wq.new_empty((0,))
        gemm_dtype = torch.bfloat16 if rowwise else out_dtype  # rowwise GEMMs write bf16
        inv_b = inv_w.reshape(1, -1) if rowwise else inv_w
        out = scaled_mm(qx, gemm_w.t(), inv_x, inv_b, gemm_dtype, fast_accum=fast_accum,
                        emulate=emulate).to(out_dtype)  # fmt: skip
        return out, qx, inv_x, kept, inv_w, torch.stack([ax, aw, sx, sw])


@fp8_linear.register_fake
def _(x, w, scales, grad_stats, out_dtype, grad_e5m2, rowwise, delayed, saturate, power_of_two,
      fast_accum, emulate, wq=None, wq_inv=None, wq_stats=None):  # fmt: skip
    m, n = x.shape[0], w.shape[0]
    inv_x = x.new_empty((m, 1) if rowwise else (), dtype=torch.float32)
    inv_w = x.new_empty((n, 1) if rowwise else (), dtype=torch.float32)
    out = x.new_empty((m, n), dtype=out_dtype)
    qx = x.new_empty(x.shape, dtype=E4M3)
    qw = w.new_empty(w.shape if wq is None else (0,), dtype=E4M3)
    return out, qx, inv_x, qw, inv_w, x.new_empty((4,), dtype=torch.float32)


@torch.library.custom_op("mixprec::fp8_linear_backward", mutates_args=("grad_stats",))
def fp8_linear_backward(
    g: Tensor,
    x: Tensor,
    inv_x: Tensor,
    w: Tensor,
    inv_w: Tensor,
    scales: Tensor,
    grad_stats: Tensor,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    grad_e5m2: bool,
    rowwise: bool,
    delayed: bool,
    saturate: bool,
    power_of_two: bool,
    emulate: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_input, grad_weight) of `fp8_linear` from the output gradient `g` (M, N).

    Tensorwise: `x`, `w` are the forward's FP8 operands and `inv_x`, `inv_w` their inverse
    scales. Rowwise: `x`, `w` are the forward's inputs, re-quantised here along the other axis.
    Records ``grad_stats = [max(grad_stats[0], amax(g)), scale used for g]`` in place.
    """
    flags = (delayed, saturate, power_of_two)
    gdt = E5M2 if grad_e5m2 else E4M3
    gmax = fp8_max(gdt)
    with _plain():
        if rowwise:
            # grad_input = g @ w reduces over N: g per row, w per column; grad_weight = g.T @ x
            # reduces over M: g per column, x per column. Rowwise GEMMs write bf16.
            qg, inv_g, ag, sg = _q(g, 1, scales[2], gmax, gdt, flags)
            qw, inv_wc, _, _ = _q(w, 0, scales[1], _E4M3_MAX, E4M3, flags)
            grad_x = scaled_mm(qg, qw, inv_g, inv_wc, torch.bfloat16, emulate=emulate)
            qg_c, inv_gc, _, _ = _q(g, 0, scales[2], gmax, gdt, flags)
            qx, inv_xc, _, _ = _q(x, 0, scales[0], _E4M3_MAX, E4M3, flags)
            grad_w = scaled_mm(qg_c.t(), qx, inv_gc.reshape(-1, 1), inv_xc, torch.bfloat16,
                               emulate=emulate)  # fmt: skip
        else:
            qg, inv_g, ag, sg = _q(g, None, scales[2], gmax, gdt, flags)
            grad_x = scaled_mm(qg, w, inv_g, inv_w, x_dtype, emulate=emulate)
            grad_w = scaled_mm(qg.t(), x, inv_g, inv_x, w_dtype, emulate=emulate)
        grad_stats.copy_(torch.stack([torch.maximum(grad_stats[0], ag), sg]))
        return grad_x.to(x_dtype), grad_w.to(w_dtype)


@fp8_linear_backward.register_fake
def _(g, x, inv_x, w, inv_w, scales, grad_stats, x_dtype, w_dtype, grad_e5m2, rowwise, delayed,
      saturate, power_of_two, emulate):  # fmt: skip
    return (g.new_empty((g.shape[0], w.shape[1]), dtype=x_dtype),
            g.new_empty((g.shape[1], x.shape[1]), dtype=w_dtype))  # fmt: skip


@torch.library.custom_op("mixprec::fp8_record", mutates_args=("fwd",))
def fp8_record(fwd: Tensor, stats: Tensor) -> None:
    """``fwd = [max(fwd[:2], stats[:2]), stats[2:]]``: this step's largest input and weight
    amax (micro-batches accumulate), and the scales the last forward used."""
    with _plain():
        fwd.copy_(torch.cat([torch.maximum(fwd[:2], stats[:2]), stats[2:]]))


@fp8_record.register_fake
def _(fwd, stats):
    return None


def _setup(ctx, inputs, output) -> None:
    x, w, scales, grad_stats, _, grad_e5m2, rowwise, delayed, saturate, power_of_two, _, emulate = (
        inputs[:12]
    )
    wq = inputs[12] if len(inputs) > 12 else None
    _, qx, inv_x, qw, inv_w, stats = output
    ctx.mark_non_differentiable(qx, inv_x, qw, inv_w, stats)
    ctx.flags = (grad_e5m2, rowwise, delayed, saturate, power_of_two, emulate)
    ctx.dtypes = (x.dtype, w.dtype)
    if rowwise:
        ctx.save_for_backward(x, inv_x, w, inv_w, scales, grad_stats)
    else:  # FP8 copies: half the bytes of bf16 activations kept for backward
        ctx.save_for_backward(qx, inv_x, qw if wq is None else wq, inv_w, scales, grad_stats)


def _backward(ctx, grad_out, *_unused):
    x, inv_x, w, inv_w, scales, grad_stats = ctx.saved_tensors
    grad_x, grad_w = fp8_linear_backward(
        grad_out.contiguous(), x, inv_x, w, inv_w, scales, grad_stats, *ctx.dtypes, *ctx.flags
    )
    return grad_x, grad_w, *([None] * 13)


fp8_linear.register_autograd(_backward, setup_context=_setup)
