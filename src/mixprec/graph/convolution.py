"""Convolutions as one matrix product, where that is faster than the convolution kernel here.

A 16-bit convolution on a CPU runs through oneDNN, which is tuned for images: many pixels, few
channels. Deep in a CIFAR-sized ResNet the roles swap: 2x2 or 1x1 feature maps, 512-2,048
channels, a batch of 8, so each convolution is a product of a few dozen rows by a wide weight,
and the kernel's backward spends its time on layouts, not arithmetic. Measured on an AMD EPYC
with avx512_bf16 (2 threads, torch 2.13), forward and backward in bf16: a 1x1 convolution from
1,024 to 2,048 channels at 2x2, stride 2, 4.0 ms as the convolution kernel, 0.83 ms as a
matrix product; a 3x3 convolution of 512 channels at 1x1, 2.5 against 1.2 ms; ResNet-50's
eleven smallest-map shapes (31 of its 53 convolutions), 36 against 17 ms a step.

`convolution_by_matmuls` computes a 2-D convolution as that product: the input's patches as
rows (``unfold``; for a 1x1 kernel just the pixels, strided), times the weight as a matrix,
the bias added in the product's accumulator (``addmm``). It is offered only where **no input
element is used by two output positions** (in each spatial dimension the stride is at least
the kernel's extent, or there is one output position), which covers 1x1 kernels and the
kernels larger than their feature map. There its arithmetic is the convolution kernel's:

- forward: each output is one sum of 16-bit products accumulated in fp32 and rounded once;
- input gradient: the patches' gradient is one such product, and placing it back into the
  input (``fold``) adds nothing, since no element gets two contributions;
- weight gradient: one product over all output positions, fp32 accumulation, one rounding.

So results differ from the convolution kernel's only in the order of fp32 sums.

Cost in memory: the product keeps its rows for the weight gradient, where the kernel keeps its
input. For a 1x1 kernel the rows are the input's (strided) pixels, a copy of at most its size;
for a kernel larger than its map they are the patches, taps in the padding included (a 3x3
kernel on a 1x1 map: nine times the input, eight ninths of it zeros). Where the route wins the
maps are small: ResNet-50's 39 routed convolutions at CIFAR size, batch 8, keep 2.6 MiB of bf16
rows (their inputs are 2.7 MiB). Where patches
overlap (a 3x3 kernel at stride 1 on a map wider than one pixel) the input gradient would be
summed in 16 bits across patches; those convolutions keep the kernel.

`mixprec.graph.kernels` times both routes at each distinct shape (forward and backward, a few
milliseconds, once per process) and uses the product where it is faster by the kernels'
margin. Maps with more than `MAX_POSITIONS` output positions per image keep the kernel
untimed: there it won every probe. The choice is made while the graph is recorded
(`mixprec.graph.routes.Routes`), so the product's backward is derived by autograd, and a graph
that takes its own gradients (a whole training step) gets it too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MAX_POSITIONS", "arguments", "convolution_by_matmuls", "decomposable", "probe_key"]

_LOW = (torch.bfloat16, torch.float16)

#: Most output positions per image the product is offered for. On larger maps the kernel won
#: every probe (AMD EPYC avx512_bf16, bf16 forward and backward: a 1x1 convolution at 16x16,
#: 0.80 ms as the kernel against 1.27 as the product; at 32x32, 2.65 against 4.63), and timing
#: them would only add compile time.
MAX_POSITIONS = 64


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int):
        return value, value
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
    ):
        return int(value[0]), int(value[1])
    return None


def arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A ``conv2d`` call's arguments by name, defaults filled in (``'valid'`` padding as 0)."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return {
        "input": bound.get("input"),
        "weight": bound.get("weight"),
        "bias": bound.get("bias"),
        "stride": bound.get("stride", 1),
        "padding": 0 if bound.get("padding", 0) == "valid" else bound.get("padding", 0),
        "dilation": bound.get("dilation", 1),
        "groups": bound.get("groups", 1),
    }


def decomposable(args: tuple, kwargs: dict) -> str | None:
    """None if the ``conv2d(*args, **kwargs)`` call can be computed as one product with the
    kernel's arithmetic, else why not (see the module docstring)."""
    a = arguments(args, kwargs)
    x, w, b = a["input"], a["weight"], a["bias"]
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return "not a tensor input and weight"
    if x.dim() != 4 or x.device.type != "cpu" or x.dtype not in _LOW:
        return "not a batched 2-D 16-bit convolution on a CPU"
    if w.dtype != x.dtype or (isinstance(b, torch.Tensor) and b.dtype != x.dtype):
        return "mixed dtypes"
    if a["groups"] != 1:
        return "grouped"
    stride, padding, dilation = (_pair(a[k]) for k in ("stride", "padding", "dilation"))
    if stride is None or padding is None or dilation is None:
        return "stride, padding or dilation not plain integers"
    sizes = [*x.shape, *w.shape]
    if not all(isinstance(s, int) for s in sizes):
        return "symbolic sizes"
    positions = 1
    for d in range(2):
        extent = dilation[d] * (w.shape[2 + d] - 1) + 1
        out = (x.shape[2 + d] + 2 * padding[d] - extent) // stride[d] + 1
        if out > 1 and stride[d] < extent:
            return "patches overlap (the input gradient would be summed in 16 bits)"
        positions *= out
    if positions > MAX_POSITIONS:
        return f"more than {MAX_POSITIONS} output positions per image (the kernel's shapes)"
    return None


def probe_key(args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """What a timing depends on: shapes, dtype, geometry, bias, which of input, weight and bias
    need a gradient (frozen layers time their forward alone), and the input's memory format."""
    a = arguments(args, kwargs)
    x, w, b = a["input"], a["weight"], a["bias"]
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    grads = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, w, b))
    return (tuple(x.shape), tuple(w.shape), x.dtype, _pair(a["stride"]), _pair(a["padding"]),
            _pair(a["dilation"]), b is not None, grads, channels_last)  # fmt: skip


def convolution_by_matmuls(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> torch.Tensor:
    """``F.conv2d`` as one matrix product (a call `decomposable` accepts), same memory format
    as the convolution kernel's result."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    n, _, h, w = input.shape
    co, ci, kh, kw = weight.shape
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if kh == kw == 1 and ph == pw == 0:
        rows = input[:, :, ::sh, ::sw].permute(0, 2, 3, 1).reshape(n * ho * wo, ci)
    else:
        cols = F.unfold(input, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
        rows = cols.transpose(1, 2).reshape(n * ho * wo, ci * kh * kw)
    matrix = weight.reshape(co, ci * kh * kw).t()
    out = rows @ matrix if bias is None else torch.addmm(bias, rows, matrix)
    out = out.reshape(n, ho, wo, co).permute(0, 3, 1, 2)  # channels-last memory
    channels_last = input.is_contiguous(memory_format=torch.channels_last)
    return out if channels_last and not input.is_contiguous() else out.contiguous()
