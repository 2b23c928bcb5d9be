"""Attention as two matrix products, where that is faster than the fused kernel on this machine.

torch's CPU ``scaled_dot_product_attention`` for bf16/fp16 inputs is a flash-attention kernel:
it computes the scores ``q @ k^T`` from the 16-bit values with fp32 accumulation and keeps them
in fp32, takes the softmax in fp32, rounds the probabilities to the 16-bit dtype and multiplies
them by ``v``, block by block, never holding the whole ``L x S`` score matrix. At the sequence
lengths small models train with, its blocks are too small to keep the matrix units busy: on an
AMD EPYC with avx512_bf16 (2 threads; bf16 GEMMs at 4x fp32's rate), a causal 8x4x128x64 bf16
attention took 5.2-5.6 ms forward and backward fused, 2.3-3.7 ms as the products below (eager),
and a 4-layer GPT's compiled step (`benchmarks/cpu_step.py`'s gpt2) ran at 1.54x torch.amp
eager with them against 1.23x with the fused kernel in fp32 (one process, routes forced).

`attention_by_matmuls` computes the same arithmetic with whole-matrix products: scores in fp32
from the 16-bit values (a product of two bf16 or fp16 numbers is exact in fp32, so an fp32
GEMM on the upcast values is the fused kernel's fp32 accumulation, summed in another order),
the scale, the mask (an additive bias the scores' GEMM starts from), an fp32 softmax, the
probabilities rounded to the 16-bit dtype, times ``v`` in a 16-bit GEMM. Its error against an
fp64 reference is close to the fused kernel's (relative, bf16, causal 2x4x128x64: output
0.22% against 0.19%, gradients of q, k, v 0.28%, 0.28%, 0.23% against 0.26%, 0.36%, 0.34%).
The scores' backward rounds their gradient to the 16-bit dtype and multiplies it in 16-bit
GEMMs with fp32 accumulation (`_Scores`), keeping the 16-bit q and k rather than fp32 copies.
Its cost is memory: the fp32 score matrix, ``4 * batch * heads * L * S`` bytes, kept for
backward, where the fused kernel keeps one row statistic per query.

`mixprec.graph.kernels` uses it where the measurement says so: each distinct attention shape
of a compiled graph is timed three ways (fused, fused in fp32, products) once per process
(forward and backward, at its own shapes, a few milliseconds), and the products replace the
fused call only when they are the fastest by the kernels' margin and the score matrix stays
under `MAX_SCORE_BYTES`. Dropout, grouped-query attention and nested tensors keep the
attention family's route (the fused kernel, or the fused kernel in fp32 where the family's
probe chose it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

__all__ = [
    "MAX_SCORE_BYTES",
    "attention_by_matmuls",
    "call_arguments",
    "decomposable",
    "inputs_like",
    "key_of",
    "layout_order",
    "output_order",
    "probe_inputs",
    "probe_key",
    "refusal",
    "rewrite",
    "sdpa_arguments",
]

#: Largest fp32 score matrix the decomposition may hold (bytes): beyond it, the fused kernel's
#: memory saving matters more than its speed (and the probe itself would allocate this much).
MAX_SCORE_BYTES = 64 * 2**20

_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")  # fmt: skip
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
             "enable_gqa": False}  # fmt: skip


def attention_by_matmuls(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dim_order: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale)`` for
    16-bit inputs, as two matrix products with fp32 scores and softmax (see the module doc).

    A row whose every key is masked out gives zeros, as torch's own math path does.
    `dim_order`: the output's dimensions from outermost to innermost in memory, where it must
    be laid out as the fused kernel lays out its own (torch's CPU kernel returns a
    ``(batch, heads, L, E)`` output stored as ``(batch, L, heads, E)``, and models may
    ``view`` its transpose without ``contiguous()``); costs one copy of the output.
    """
    low = query.dtype
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    batch, length, source = query.shape[:-2], query.size(-2), key.size(-2)
    # The mask as an additive bias (0 or -inf) that the scores' GEMM starts from, and the
    # scale as its alpha: one kernel where a product, a multiplication and a masked fill
    # would each make a pass over the L x S scores.
    fp32 = {"dtype": torch.float32, "device": query.device}
    bias, beta = torch.zeros((), **fp32), 1.0
    if is_causal:
        above = torch.ones(length, source, dtype=torch.bool, device=query.device).triu(1)
        bias = torch.zeros(length, source, **fp32).masked_fill(above, -math.inf)
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, **fp32)
        bias = bias.masked_fill(attn_mask.logical_not(), -math.inf)
    elif attn_mask is not None:
        bias = attn_mask.float()
    else:
        beta = 0.0  # no mask: the GEMM ignores the bias
    if bias.dim() > 2 and bias.shape[:-2].numel() == 1:
        bias = bias.reshape(bias.shape[-2:])
    elif bias.dim() > 2:  # a per-batch mask: one bias matrix per (batch, head)
        bias = bias.expand(*batch, length, source).reshape(-1, length, source)
    q3 = query.reshape(-1, length, query.size(-1))
    k3 = key.reshape(-1, source, key.size(-1))
    if bias.requires_grad:  # a learned float mask: plain autograd, which also differentiates it
        scores = torch.baddbmm(bias, q3.float(), k3.float().transpose(1, 2), beta=beta,
                               alpha=factor)  # fmt: skip
    else:
        scores = _Scores.apply(q3, k3, bias, beta, factor)
    if attn_mask is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.ops.aten._safe_softmax(scores, -1)
    out = torch.bmm(probs.to(low), value.reshape(-1, source, value.size(-1)))
    out = out.view(*batch, length, value.size(-1))
    if dim_order is None:
        return out
    inverse = sorted(range(len(dim_order)), key=dim_order.__getitem__)
    return out.permute(dim_order).contiguous().permute(inverse)


class _Scores(torch.autograd.Function):
    """``beta * bias + alpha * q @ k^T`` in fp32 from 16-bit ``q``, ``k`` (3-D); the backward
    in 16-bit arithmetic: the scores' gradient (times alpha) rounded to the 16-bit dtype, then
    16-bit GEMMs with fp32 accumulation for the gradients of ``q`` and ``k``.

    Autograd through the fp32 product would run those two GEMMs in fp32 (at a quarter of the
    bf16 rate on a CPU with bf16 units) and keep fp32 copies of ``q`` and ``k`` for them; this
    keeps the 16-bit tensors themselves.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, beta: float,
                alpha: float) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(q, k)
        ctx.alpha = alpha
        return torch.baddbmm(bias, q.float(), k.float().transpose(1, 2), beta=beta, alpha=alpha)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k = ctx.saved_tensors
        low = (grad * ctx.alpha).to(q.dtype)
        dq = torch.bmm(low, k) if ctx.needs_input_grad[0] else None
        dk = torch.bmm(low.transpose(1, 2), q) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None, None


def output_order(node: fx.Node) -> tuple[int, ...] | None:
    """The fused kernel's output layout for `node` as a dimension order, None if contiguous."""
    val = node.meta.get("val")
    return layout_order(val) if isinstance(val, torch.Tensor) else None


def layout_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s dimensions from outermost to innermost in memory, None if contiguous."""
    if t.is_contiguous():
        return None
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    """The arguments of an ``aten.scaled_dot_product_attention`` node, by name."""
    return call_arguments(node.args, node.kwargs)


def call_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a ``scaled_dot_product_attention(*args, **kwargs)`` call, by name."""
    named = dict(_DEFAULTS)
    named.update(zip(_SIGNATURE, args, strict=False))
    named.update(kwargs)
    return named


def _values(node: fx.Node) -> dict[str, Any]:
    """`node`'s arguments by name, each node replaced by its recorded (fake) value."""
    return {
        name: (arg.meta.get("val") if isinstance(arg, fx.Node) else arg)
        for name, arg in sdpa_arguments(node).items()
    }


def decomposable(node: fx.Node) -> str | None:
    """Why `node` (an SDPA call with 16-bit fake values) must keep the fused kernel, or None."""
    return refusal(_values(node))


def refusal(named: dict[str, Any]) -> str | None:
    """Why an attention with these arguments (by name, tensors or fake tensors) must keep the
    fused kernel, or None."""
    vals = [named[n] for n in ("query", "key", "value")]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return "its inputs carry no shapes"
    query, key, _ = vals
    if named["dropout_p"] != 0.0:
        return "it applies dropout (the fused kernel draws its own mask)"
    if named["enable_gqa"]:
        return "grouped-query attention (enable_gqa=True)"
    if query.is_nested or query.dim() < 3 or query.shape[:-2] != key.shape[:-2]:
        return "its query and key batch shapes differ (broadcasting or nested inputs)"
    if named["attn_mask"] is not None and named["is_causal"]:
        return "both attn_mask and is_causal are given"
    if not all(isinstance(s, int) for v in vals for s in v.shape):
        return "symbolic sizes"
    nbytes = 4 * query.shape[:-1].numel() * key.shape[-2]
    if nbytes > MAX_SCORE_BYTES:
        return (
            f"its fp32 score matrix would take {nbytes / 2**20:.0f} MiB (more than "
            f"{MAX_SCORE_BYTES // 2**20} MiB): the fused kernel never holds it"
        )
    return None


def probe_key(node: fx.Node) -> tuple[Any, ...]:
    """What the timing of `node` depends on (see `key_of`)."""
    return key_of(_values(node))


def key_of(named: dict[str, Any]) -> tuple[Any, ...]:
    """What an attention's timing depends on: its inputs' shapes and dtypes, the mask's, the
    causal flag and the scale (a cache key; nothing is allocated)."""
    mask = named["attn_mask"]
    return (
        *((tuple(named[n].shape), named[n].dtype) for n in ("query", "key", "value")),
        None if not isinstance(mask, torch.Tensor) else (tuple(mask.shape), mask.dtype),
        bool(named["is_causal"]),
        named["scale"],
    )


def probe_inputs(node: fx.Node) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Random real tensors with `node`'s shapes and dtypes, and its other arguments."""
    return inputs_like(key_of(_values(node)))


def inputs_like(key: tuple[Any, ...]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Random real tensors with the shapes and dtypes of a `key_of` key, and the other
    arguments (allocates: call it where the timing runs, not while a graph is recorded)."""
    *qkv, mask, is_causal, scale = key
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(shape, generator=g) * 0.5).to(dtype) for shape, dtype in qkv]
    kwargs: dict[str, Any] = {"is_causal": is_causal, "scale": scale}
    if mask is not None:
        shape, dtype = mask
        if dtype == torch.bool:
            kwargs["attn_mask"] = torch.rand(shape, generator=g) > 0.2
        else:
            kwargs["attn_mask"] = torch.zeros(shape, dtype=dtype)
    return tensors, kwargs


def rewrite(graph: fx.Graph, node: fx.Node) -> None:
    """Replace the SDPA call `node` by `attention_by_matmuls` on the same arguments."""
    args = sdpa_arguments(node)
    with graph.inserting_before(node):
        new = graph.call_function(
            attention_by_matmuls,
            (args["query"], args["key"], args["value"]),
            {
                "attn_mask": args["attn_mask"],
                "is_causal": bool(args["is_causal"]),
                "scale": args["scale"],
                "dim_order": output_order(node),
            },
        )
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
