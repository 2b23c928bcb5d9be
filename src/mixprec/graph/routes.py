"""Kernel routes taken while a graph is recorded, so that autograd derives their backward.

`mixprec.graph.kernels` chooses how a heavy 16-bit op is computed on a CPU. Most choices are
made on the recorded aten graph (a cast around the op). Two replace the op by other ops: a
small-map convolution as one matrix product (`mixprec.graph.convolution`) and attention as two
(`mixprec.graph.attention`). Those are made here, while the graph is recorded, by `Routes`, a
torch function mode, so that the replacement's backward is what autograd derives from the
replacement's own ops (and its custom backward, `attention._Scores`):

- in a forward graph, whose backward AOTAutograd derives after recording;
- in a graph that takes its own gradients (a whole training step, `mixprec.step.whole`), whose
  backward is recorded from the autograd engine as it runs; a choice made afterwards on the
  aten graph could replace the forward op but not its already recorded backward.

`Routes` is entered *below* the policy's region (before it): it sees each call with the dtypes
the region gave it, and the replacement's own ops run under no mode, so the region does not
recast them. Each decision is a `KernelChoice` kept in `Routes.choices`, which
`mixprec.graph.trace.trace_with_policy` hands to `choose_kernels` with the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixprec.graph.attention import attention_by_matmuls, call_arguments
from mixprec.graph.convolution import convolution_by_matmuls, decomposable

__all__ = ["Routes"]


class Routes(TorchFunctionMode):
    """While a graph is recorded: ``conv2d`` and (optionally) attention calls by their route.

    Args:
        convolution: ``(args, kwargs) -> KernelChoice | None`` for a ``conv2d`` call that
            `convolution.decomposable` accepts (`mixprec.graph.kernels.decide_convolution`).
        attention: ``(args, kwargs) -> (KernelChoice, output layout) | None`` for a
            ``scaled_dot_product_attention`` call (`mixprec.graph.kernels.decide_attention`);
            None leaves attention to `choose_kernels` (a forward graph: it is rewritten there).
    """

    def __init__(
        self, convolution: Callable[..., Any], attention: Callable[..., Any] | None = None
    ) -> None:
        super().__init__()
        self._convolution = convolution
        self._attention = attention
        self.choices: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.conv2d and decomposable(args, kwargs) is None:
            choice = self._convolution(args, kwargs)
            if choice is not None:
                self.choices.append(choice)
                if choice.route == "matmuls":
                    return convolution_by_matmuls(*args, **kwargs)
        elif func is F.scaled_dot_product_attention and self._attention is not None:
            decided = self._attention(args, kwargs)
            if decided is not None:
                choice, order = decided
                self.choices.append(choice)
                if choice.route != "native":
                    return _attention(choice.route, order, call_arguments(args, kwargs))
        return func(*args, **kwargs)


def _attention(route: str, order: Any, named: dict[str, Any]) -> torch.Tensor:
    q, k, v, mask = (named[n] for n in ("query", "key", "value", "attn_mask"))
    if route == "matmuls":
        return attention_by_matmuls(q, k, v, mask, bool(named["is_causal"]), named["scale"],
                                    dim_order=order)  # fmt: skip
    low = q.dtype  # "fp32": the fused kernel on the same 16-bit values, rounded once
    if isinstance(mask, torch.Tensor) and mask.dtype == low:
        mask = mask.float()
    causal, scale = bool(named["is_causal"]), named["scale"]
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), mask, is_causal=causal, scale=scale
    )
    return out.to(low)
