"""Choosing, per machine, how a low-precision matmul, convolution or attention is computed.

A policy says *which dtype* an op runs in; it does not say *which kernel* computes it. On most
accelerators the 16-bit kernel is the fast one. On many CPUs it is not: a CPU without native
bf16/fp16 matrix instructions (AVX2-only x86, for example) runs torch's 16-bit GEMMs through a
reference kernel that can be 50-100x slower than its fp32 GEMM, so "mixed precision" there is
the slowest way to train.

This pass measures, at compile time, each heavy op of a graph the policy put in the low dtype
(``linear``, ``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``, convolutions, attention), on
this machine, with its shapes, two ways:

- ``native``: the op's own low-precision kernel;
- ``fp32``: the same op computed in fp32 on the same low-precision values, its result rounded to
  the low dtype.

and keeps the faster. The ``fp32`` route computes what the low-precision op computes: the
inputs are the same low-precision numbers (a product of two bf16 or fp16 values is exact in
fp32), products are accumulated in fp32 as the 16-bit kernels do, and the result is rounded to
the low dtype once. Results differ from the native kernel only by the order of the fp32 sums
(about one low-precision ulp in a few elements in a thousand), and the backward follows the
same casts, so gradients keep the low dtype where the policy put them.

Measurements are cached per process by (op, shapes, dtype, device); an op too large to time
quickly is timed at fewer rows (the leading dimension), which keeps the ratio and bounds the
compile-time cost to a fraction of a second per distinct shape. Every decision is recorded
with its timings in a `KernelChoice`, shown by `mixprec.AmpBackend.kernel_summary` and
``TrainStep.explain()``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from mixprec.dtypes import dtype_name
from mixprec.errors import PolicyError, format_options

__all__ = ["HEAVY_OPS", "KERNEL_MODES", "KernelChoice", "choose_kernels"]

aten = torch.ops.aten

#: The ops whose kernel is chosen, and the argument positions of their floating inputs.
HEAVY_OPS: dict[Any, tuple[int, ...]] = {
    aten.linear.default: (0, 1, 2),
    aten.matmul.default: (0, 1),
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (0, 1, 2),
    aten.baddbmm.default: (0, 1, 2),
    aten.conv1d.default: (0, 1, 2),
    aten.conv2d.default: (0, 1, 2),
    aten.conv3d.default: (0, 1, 2),
    aten.convolution.default: (0, 1, 2),
    aten.scaled_dot_product_attention.default: (0, 1, 2, 3),
}

#: Values of ``kernels``: what each does.
KERNEL_MODES = {
    "auto": "measure each heavy low-precision op both ways on this machine and keep the faster",
    "native": "always the op's own low-precision kernel (no measurement)",
    "fp32": "always compute heavy low-precision ops in fp32 on the low-precision values",
}

_LOW = (torch.bfloat16, torch.float16)
# An op is timed at no more than about this many multiply-adds (fewer rows above it): a 16-bit
# GEMM on a CPU without 16-bit units runs at about 1 GFLOP/s.
_MAX_WORK = 1.0e7
_MARGIN = 1.1  # the fp32 route must win by this factor: casts cost something the timing misses


@dataclass(frozen=True)
class KernelChoice:
    """How one heavy op of a compiled graph is computed, and why.

    Attributes:
        op: the aten op (``'aten.linear'``).
        shapes: its input shapes, as compiled.
        dtype: the low dtype the policy put it in.
        route: ``'native'`` or ``'fp32'``.
        native_ms, fp32_ms: measured forward + backward times (at fewer rows when the op was
            too large to time whole); None when not measured.
        reason: the decision in words.
    """

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    route: str
    native_ms: float | None
    fp32_ms: float | None
    reason: str

    def __str__(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.op}({shapes}) {self.dtype}: {self.route}: {self.reason}"


_CACHE: dict[tuple[Any, ...], tuple[float, float]] = {}


def choose_kernels(gm: fx.GraphModule, device_type: str, mode: str = "auto") -> list[KernelChoice]:
    """Choose the route of every heavy low-precision op of `gm` (in place); return the choices.

    Args:
        gm: an aten-level graph whose nodes carry fake values (``node.meta['val']``), such as
            `mixprec.graph.trace.trace_with_policy` records.
        device_type: where the graph runs; only CPU graphs are measured (GPUs have fast 16-bit
            kernels, and timing them at compile time would cost more than it could find).
        mode: see `KERNEL_MODES`.
    """
    if mode not in KERNEL_MODES:
        raise PolicyError(f"unknown kernels mode {mode!r}; valid: {format_options(KERNEL_MODES)}.")
    if mode == "native" or device_type != "cpu":
        return []
    choices = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in HEAVY_OPS:
            continue
        inputs = _floating_inputs(node)
        out = node.meta.get("val")
        if not inputs or not isinstance(out, torch.Tensor) or out.dtype not in _LOW:
            continue
        if any(t.dtype != out.dtype for t in inputs):
            continue  # mixed dtypes: the op promotes; nothing to choose
        choice = _decide(node, out.dtype, mode)
        choices.append(choice)
        if choice.route == "fp32":
            _rewrite(gm.graph, node, out.dtype)
    if any(c.route == "fp32" for c in choices):
        gm.graph.lint()
        gm.recompile()
    return choices


def _floating_inputs(node: fx.Node) -> list[torch.Tensor]:
    vals = []
    for i in HEAVY_OPS[node.target]:
        if i < len(node.args) and isinstance(node.args[i], fx.Node):
            val = node.args[i].meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                vals.append(val)
    return vals


def _decide(node: fx.Node, low: torch.dtype, mode: str) -> KernelChoice:
    name = str(node.target).replace(".default", "")
    shapes = tuple(tuple(int(s) for s in t.shape) for t in _floating_inputs(node))
    if mode == "fp32":
        return KernelChoice(name, shapes, dtype_name(low), "fp32", None, None,
                            "requested (kernels='fp32')")  # fmt: skip
    key = (node.target, shapes, low, _scalar_args(node))
    if key not in _CACHE:
        _CACHE[key] = _measure(node, low)
    native, fp32 = _CACHE[key]
    if fp32 * _MARGIN < native:
        reason = (
            f"the {dtype_name(low)} kernel took {native:.3g} ms, fp32 on the same "
            f"{dtype_name(low)} values {fp32:.3g} ms (this CPU has no fast "
            f"{dtype_name(low)} kernel for it); the result is rounded to {dtype_name(low)} "
            f"as the op's own would be"
        )
        route = "fp32"
    else:
        reason = f"the {dtype_name(low)} kernel is the faster ({native:.3g} vs {fp32:.3g} ms)"
        route = "native"
    return KernelChoice(name, shapes, dtype_name(low), route, native, fp32, reason)


def _scalar_args(node: fx.Node) -> tuple[Any, ...]:
    """The non-tensor arguments, hashable (stride, padding, is_causal...): part of the key."""

    def plain(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return "tensor"
        if isinstance(a, (list, tuple)):
            return tuple(plain(x) for x in a)
        return a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)

    return plain(node.args), tuple(sorted((k, plain(v)) for k, v in node.kwargs.items()))


def _materialize(node: fx.Node, dtype: torch.dtype) -> tuple[list[Any], dict[str, Any]]:
    """Real random arguments like the node's, with fewer rows where the op is large."""
    first = _floating_inputs(node)[0]
    inner = math.prod(first.shape[1:]) if first.dim() > 1 else 1
    # Multiply-adds ~ output elements x reduction size; shrinking the leading dimension of the
    # first input (rows, batch) shrinks the work in proportion.
    estimate = float(node.meta["val"].numel()) * max(inner, 1)
    keep = min(1.0, _MAX_WORK / max(estimate, 1.0))
    rows = max(1, int(first.shape[0] * keep)) if first.dim() > 0 else 1
    generator = torch.Generator().manual_seed(0)

    def real(a: Any, position: int) -> Any:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                shape = [int(s) for s in val.shape]
                # Every input that shares the first input's leading size shrinks with it
                # (attention's q, k, v; a batched matmul's operands), weights keep theirs.
                if shape and position in _ROW_ARGS.get(node.target, (0,)):
                    shape[0] = rows
                if val.is_floating_point():
                    return (torch.randn(shape, generator=generator) * 0.1).to(dtype)
                return torch.zeros(shape, dtype=val.dtype)
            return val
        return a

    args = [real(a, i) for i, a in enumerate(node.args)]
    kwargs = {k: real(v, -1) for k, v in node.kwargs.items()}
    return args, kwargs


# Argument positions whose leading dimension is the batch (shrunk together when timing).
_ROW_ARGS: dict[Any, tuple[int, ...]] = {
    aten.bmm.default: (0, 1),
    aten.baddbmm.default: (0, 1, 2),
    aten.scaled_dot_product_attention.default: (0, 1, 2, 3),
    aten.matmul.default: (0,),
}


def _measure(node: fx.Node, low: torch.dtype) -> tuple[float, float]:
    """Forward + backward time (ms) of the op natively and through fp32, at its (or fewer) rows."""
    args, kwargs = _materialize(node, low)
    op = node.target
    positions = [i for i in HEAVY_OPS[op] if i < len(args) and isinstance(args[i], torch.Tensor)]

    def native() -> None:
        inputs = list(args)
        for i in positions:
            inputs[i] = args[i].detach().requires_grad_()
        out = op(*inputs, **kwargs)
        out.backward(torch.ones_like(out))

    def via_fp32() -> None:
        inputs = list(args)
        for i in positions:
            inputs[i] = args[i].detach().requires_grad_()
        cast = list(inputs)
        for i in positions:
            if cast[i].is_floating_point():
                cast[i] = cast[i].float()
        out = op(*cast, **kwargs).to(low)
        out.backward(torch.ones_like(out))

    return _time_pair(native, via_fp32)


def _time_pair(a: Any, b: Any, rounds: int = 3) -> tuple[float, float]:
    """Best-of-`rounds` times (ms) of `a` and `b`, run alternately after one warm-up call each
    (a kernel's first call builds its plan): load from other processes then hits both alike."""
    with torch.enable_grad():
        a()
        b()
        best = [math.inf, math.inf]
        for _ in range(rounds):
            for i, fn in enumerate((a, b)):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
        return best[0], best[1]


def _rewrite(graph: fx.Graph, node: fx.Node, low: torch.dtype) -> None:
    """``op(a, b)`` -> ``op(a.to(fp32), b.to(fp32)).to(low)``, with fake values kept."""
    to = aten.to.dtype
    with graph.inserting_before(node):
        args = list(node.args)
        for i in HEAVY_OPS[node.target]:
            if i < len(args) and isinstance(args[i], fx.Node):
                val = args[i].meta.get("val")
                if isinstance(val, torch.Tensor) and val.dtype == low:
                    cast = graph.call_function(to, (args[i], torch.float32))
                    cast.meta["val"] = val.to(torch.float32)
                    args[i] = cast
        node.args = tuple(args)
    with graph.inserting_after(node):
        back = graph.call_function(to, (node, low))
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    back.meta["val"] = node.meta["val"]
    node.meta["val"] = node.meta["val"].to(torch.float32)
