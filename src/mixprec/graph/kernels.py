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

and keeps the faster. Attention has a third route, ``matmuls``: the fused kernel's arithmetic
as two whole-matrix products (`mixprec.graph.attention`). The three are timed at each
attention's own shapes, because which wins depends on the sequence length: on an AMD EPYC
with avx512_bf16 (2 threads), bf16 causal attention forward and backward at 8x4x128x64 took
5.6 ms fused, 4.1 ms fused in fp32, 3.7 ms as products; at 4x12x512x64, 58, 67 and 100 ms.

The ``fp32`` route computes what the low-precision op computes: the inputs are the same
low-precision numbers (a product of two bf16 or fp16 values is exact in fp32), products are
accumulated in fp32 as the 16-bit kernels do, and the result is rounded to the low dtype once.
Results differ from the native kernel only by the order of the fp32 sums (about one
low-precision ulp in a few elements in a thousand), and the backward follows the same casts, so
gradients keep the low dtype where the policy put them.

For the ``fp32`` route, what is measured is an op *family* (matrix products, convolutions,
attention), once per process, dtype and device, at one representative size: whether a machine
has 16-bit units is a property of the machine and the family, not of each shape, and timing
every distinct shape of a ResNet-50 cost minutes of compile time where one probe per family
costs a fraction of a second. A family whose two routes are within 10% keeps the native
kernel. Every decision is recorded with the probe's timings in a `KernelChoice`, shown by
`mixprec.AmpBackend.kernel_summary` and ``TrainStep.explain()``.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from mixprec.dtypes import dtype_name
from mixprec.errors import PolicyError, format_options
from mixprec.graph import attention, convolution

__all__ = [
    "FAMILIES",
    "HEAVY_OPS",
    "KERNEL_MODES",
    "KernelChoice",
    "choose_kernels",
    "decide_attention",
    "decide_convolution",
    "probe",
    "summary",
]

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
    "auto": (
        "measure each op family both ways on this machine (once) and keep the faster; "
        "attention also against two matrix products, per shape"
    ),
    "native": "always the op's own low-precision kernel (no measurement)",
    "fp32": "always compute heavy low-precision ops in fp32 on the low-precision values",
}

#: ``gm.meta[RECORDED]``: the `KernelChoice` s a graph's recording made (`convolution.Routes`).
RECORDED = "mixprec_recorded_kernel_choices"

_LOW = (torch.bfloat16, torch.float16)
_MARGIN = 1.1  # the fp32 route must win by this factor: casts cost something the timing misses


@dataclass(frozen=True)
class KernelChoice:
    """How one heavy op of a compiled graph is computed, and why.

    Attributes:
        op: the aten op (``'aten.linear'``).
        shapes: its input shapes, as compiled.
        dtype: the low dtype the policy put it in.
        route: ``'native'``, ``'fp32'``, (attention, a convolution) ``'matmuls'``, or (a
            backward op left to torch's kernel on a CPU, `mixprec.graph.lowering`) ``'aten'``.
        native_ms, fp32_ms: the family probe's forward + backward times (one representative
            size per family, not this op's shapes; for attention under ``kernels='auto'``,
            this op's own shapes; for a convolution routed to a product, the convolution
            kernel's at its shapes); None when not measured.
        reason: the decision in words.
        matmuls_ms: attention or a convolution under ``kernels='auto'``: the forward +
            backward time of the product route at this op's shapes; None otherwise.
    """

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    route: str
    native_ms: float | None
    fp32_ms: float | None
    reason: str
    matmuls_ms: float | None = None

    def __str__(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.op}({shapes}) {self.dtype}: {self.route}: {self.reason}"


_CACHE: dict[tuple[str, torch.dtype], tuple[float, float]] = {}


def summary(choices: list[KernelChoice]) -> str:
    """`choices` as text, one line per distinct op, shapes and decision (with a count)."""
    counts: dict[str, int] = {}
    for choice in choices:
        counts[str(choice)] = counts.get(str(choice), 0) + 1
    return "\n".join(f"{n} x {line}" if n > 1 else line for line, n in counts.items())


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
    choices = list(gm.meta.get(RECORDED, ()))  # routes taken while the graph was recorded
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in HEAVY_OPS:
            continue
        inputs = _floating_inputs(node)
        out = node.meta.get("val")
        if not inputs or not isinstance(out, torch.Tensor) or out.dtype not in _LOW:
            continue
        if any(t.dtype != out.dtype for t in inputs):
            continue  # mixed dtypes: the op promotes; nothing to choose
        by_shape = mode == "auto" and FAMILIES[node.target] == "attention"
        if by_shape and attention.decomposable(node) is None:
            choice = _decide_attention(node, out.dtype)
        else:
            choice = _decide(node, out.dtype, mode)
        choices.append(choice)
        if choice.route == "fp32":
            _rewrite(gm.graph, node, out.dtype)
        elif choice.route == "matmuls":
            attention.rewrite(gm.graph, node)
    if any(c.route != "native" for c in choices):
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


#: The op families, and each op's family.
FAMILIES = {
    aten.linear.default: "matmul",
    aten.matmul.default: "matmul",
    aten.mm.default: "matmul",
    aten.bmm.default: "matmul",
    aten.addmm.default: "matmul",
    aten.baddbmm.default: "matmul",
    aten.conv1d.default: "convolution",
    aten.conv2d.default: "convolution",
    aten.conv3d.default: "convolution",
    aten.convolution.default: "convolution",
    aten.scaled_dot_product_attention.default: "attention",
}


def _decide(node: fx.Node, low: torch.dtype, mode: str) -> KernelChoice:
    name = str(node.target).replace(".default", "")
    shapes = tuple(tuple(int(s) for s in t.shape) for t in _floating_inputs(node))
    if mode == "fp32":
        return KernelChoice(name, shapes, dtype_name(low), "fp32", None, None,
                            "requested (kernels='fp32')")  # fmt: skip
    family = FAMILIES[node.target]
    native, fp32 = probe(family, low)
    where = f"{family} probe ({_PROBE_TEXT[family]}, forward and backward)"
    if fp32 * _MARGIN < native:
        reason = (
            f"the {dtype_name(low)} kernel took {native:.3g} ms in the {where}, fp32 on the same "
            f"{dtype_name(low)} values {fp32:.3g} ms (this CPU has no fast {dtype_name(low)} "
            f"{family} kernel); the result is rounded to {dtype_name(low)} as the op's own would be"
        )
        route = "fp32"
    else:
        reason = (
            f"the {dtype_name(low)} kernel is the faster ({native:.3g} vs {fp32:.3g} ms, {where})"
        )
        route = "native"
    return KernelChoice(name, shapes, dtype_name(low), route, native, fp32, reason)


_PROBE_TEXT = {
    "matmul": "256x512 by 512x512",
    "convolution": "8x64x16x16, 64x64x3x3",
    "attention": "4x4x128x64, causal",
}


def _probe_args(family: str, dtype: torch.dtype) -> tuple[Any, list[torch.Tensor], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    if family == "matmul":
        return torch.nn.functional.linear, [rand(256, 512), rand(512, 512)], {}
    if family == "convolution":
        return (torch.nn.functional.conv2d, [rand(8, 64, 16, 16), rand(64, 64, 3, 3)],
                {"padding": 1})  # fmt: skip
    q = [rand(4, 4, 128, 64) for _ in range(3)]
    return torch.nn.functional.scaled_dot_product_attention, q, {"is_causal": True}


def probe(family: str, low: torch.dtype) -> tuple[float, float]:
    """(native, fp32-route) forward + backward times in ms of `family` on this CPU, cached."""
    key = (family, low)
    if key not in _CACHE:
        op, args, kwargs = _probe_args(family, low)
        native, fp32 = _run_once(op, args, **kwargs), _run_once(_in_fp32(op, low), args, **kwargs)
        _CACHE[key] = _in_own_thread(lambda: _time_pair(native, fp32))
    return _CACHE[key]


def _in_fp32(op: Any, low: torch.dtype) -> Any:
    """`op` computed in fp32 on its tensor arguments, the result rounded to `low` (the fp32
    route of a 16-bit op)."""

    def in_fp32(*args: Any, **kwargs: Any) -> torch.Tensor:
        cast = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        return op(*cast, **kwargs).to(low)

    return in_fp32


def _run_once(
    op: Any, tensors: list[Any], *rest: Any, needs: tuple[bool, ...] | None = None, **kwargs: Any
) -> Any:
    """A timed route: ``op(*tensors, *rest, **kwargs)`` on fresh leaves of `tensors` (those
    `needs` marks, all by default, requiring a gradient), then its backward where it has one."""

    def go() -> None:
        wants = needs if needs is not None else (True,) * len(tensors)
        inputs = [t.detach().requires_grad_(w) if isinstance(t, torch.Tensor) else t
                  for t, w in zip(tensors, wants, strict=True)]  # fmt: skip
        out = op(*inputs, *rest, **kwargs)
        if out.requires_grad:
            out.backward(torch.ones_like(out))

    return go


def _in_own_thread(timing: Any) -> Any:
    """`timing()` run on a thread of its own, its result or error handed back.

    The caller may be compiling inside an autocast region (TrainStep's O1 forward), whose
    thread-local state would run an fp32 route in the low dtype too (both routes then measure
    the 16-bit kernel); a new thread starts with no autocast, no dispatch or function modes
    and gradients enabled.
    """
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(timing())
        except BaseException as err:  # re-raised in the caller's thread
            result.append(err)

    worker = threading.Thread(target=run, name="mixprec-kernel-probe")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


#: `mixprec.graph.attention.key_of` -> (fused, fused in fp32, two products) ms and the fused
#: kernel's output layout, per process.
_ATTENTION_CACHE: dict[tuple[Any, ...], tuple[float, float, float, Any]] = {}


def _decide_attention(node: fx.Node, low: torch.dtype) -> KernelChoice:
    """The fastest of three routes for the attention `node`, timed at its own shapes.

    Which one wins depends on the sequence length (the products hold the whole score matrix),
    so unlike the other families attention is measured per distinct shape, a few milliseconds
    each: the fused 16-bit kernel, the fused kernel in fp32 on the 16-bit values, and
    `mixprec.graph.attention.attention_by_matmuls`.
    """
    choice, _ = _attention_choice(attention.probe_key(node), low)
    return choice


def decide_attention(args: tuple, kwargs: dict) -> tuple[KernelChoice, Any] | None:
    """For a ``scaled_dot_product_attention`` call while a graph that takes its own gradients
    is recorded (`convolution.Routes`): its route as `_decide_attention` chooses it, and the
    fused kernel's output layout (for the products); None where the call must keep the fused
    kernel (16-bit CPU inputs only, `attention.refusal`)."""
    named = attention.call_arguments(args, kwargs)
    if attention.refusal(named) is not None:
        return None
    qkv = [named[n] for n in ("query", "key", "value")]
    low = qkv[0].dtype
    if low not in _LOW or any(t.dtype != low or t.device.type != "cpu" for t in qkv):
        return None
    return _attention_choice(attention.key_of(named), low)


def _attention_choice(key: tuple[Any, ...], low: torch.dtype) -> tuple[KernelChoice, Any]:
    if key not in _ATTENTION_CACHE:
        fused = torch.nn.functional.scaled_dot_product_attention

        def measure() -> tuple[float, float, float, Any]:
            # The inputs are made here, on the probe's thread: the caller may be recording.
            tensors, kwargs = attention.inputs_like(key)
            order = attention.layout_order(fused(*tensors, **kwargs))

            def by_matmuls(*qkv: torch.Tensor, **kw: Any) -> torch.Tensor:
                return attention.attention_by_matmuls(*qkv, **kw, dim_order=order)

            routes = (fused, _in_fp32(fused, low), by_matmuls)
            return (*_time_routes(*(_run_once(r, tensors, **kwargs) for r in routes)), order)

        _ATTENTION_CACHE[key] = _in_own_thread(measure)
    native_ms, fp32_ms, matmuls_ms, order = _ATTENTION_CACHE[key]
    name = dtype_name(low)
    shapes = tuple(shape for shape, _ in key[:3])
    timings = (
        f"forward and backward at these shapes: fused {name} kernel {native_ms:.3g} ms, fused "
        f"in fp32 {fp32_ms:.3g} ms, two matrix products {matmuls_ms:.3g} ms"
    )
    best = min(fp32_ms, matmuls_ms)
    if best * _MARGIN >= native_ms:
        route, reason = "native", f"the fused {name} kernel is the fastest ({timings})"
    elif matmuls_ms <= fp32_ms:
        route = "matmuls"
        reason = (
            f"two matrix products are the fastest ({timings}): fp32 scores from the {name} "
            f"values, fp32 softmax, {name} probabilities times v, the fused kernel's arithmetic; "
            f"the fp32 scores are kept for backward"
        )
    else:
        route = "fp32"
        reason = (
            f"fp32 on the same {name} values is the fastest ({timings}); the result is rounded "
            f"to {name} as the op's own would be"
        )
    choice = KernelChoice("aten.scaled_dot_product_attention", shapes, name, route, native_ms,
                          fp32_ms, reason, matmuls_ms)  # fmt: skip
    return choice, order


#: `mixprec.graph.convolution.probe_key` -> (kernel, product) ms, per process.
_CONVOLUTION_CACHE: dict[tuple[Any, ...], tuple[float, float]] = {}


def _family_in_fp32(family: str, low: torch.dtype) -> bool:
    """Whether ``kernels='auto'`` computes `family`'s ops in fp32 on this machine."""
    native, fp32 = probe(family, low)
    return fp32 * _MARGIN < native


def decide_convolution(args: tuple, kwargs: dict) -> KernelChoice | None:
    """The ``'matmuls'`` route for a ``conv2d`` call (one `convolution.decomposable` accepts)
    when its product is faster at these shapes, timed once per process; else None (the
    convolution family's route then applies, `choose_kernels`).

    Each route is timed as it would run: the convolution in fp32 where the family's probe
    chose fp32 on this machine, the product likewise by the matrix-product family's probe.
    """
    call = convolution.arguments(args, kwargs)
    x, w = call["input"], call["weight"]
    geometry = tuple(call[k] for k in ("stride", "padding", "dilation", "groups"))
    low = x.dtype
    key = convolution.probe_key(args, kwargs)
    if key not in _CONVOLUTION_CACHE:
        conv = torch.nn.functional.conv2d
        product = convolution.convolution_by_matmuls
        if _family_in_fp32("convolution", low):
            conv = _in_fp32(conv, low)
        if _family_in_fp32("matmul", low):
            product = _in_fp32(product, low)
        bias = call["bias"]
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (x, w, bias)]

        def measure() -> tuple[float, float]:
            # The inputs are made here, on the probe's thread: the caller may be recording.
            g = torch.Generator().manual_seed(0)
            tensors = [None if shape is None else (torch.randn(shape, generator=g) * 0.1).to(low)
                       for shape in shapes]  # fmt: skip
            if key[-1]:  # a channels-last input
                tensors[0] = tensors[0].contiguous(memory_format=torch.channels_last)
            runs = [_run_once(r, tensors, *geometry, needs=key[-2]) for r in (conv, product)]
            return _time_routes(*runs)

        _CONVOLUTION_CACHE[key] = _in_own_thread(measure)
    kernel_ms, product_ms = _CONVOLUTION_CACHE[key]
    if product_ms * _MARGIN >= kernel_ms:
        return None
    name = dtype_name(low)
    shapes = tuple(tuple(int(n) for n in t.shape) for t in (x, w))
    reason = (
        f"one matrix product is the faster (forward and backward at these shapes: the "
        f"convolution kernel {kernel_ms:.3g} ms, the product {product_ms:.3g} ms); no input "
        f"element feeds two outputs, so its {name} arithmetic is the kernel's"
    )
    return KernelChoice("aten.conv2d", shapes, name, "matmuls", kernel_ms, None, reason,
                        product_ms)  # fmt: skip


def _time_pair(a: Any, b: Any, rounds: int = 3) -> tuple[float, float]:
    """Best-of-`rounds` times (ms) of `a` and `b` (see `_time_routes`)."""
    first, second = _time_routes(a, b, rounds=rounds)
    return first, second


def _time_routes(*routes: Any, rounds: int = 3) -> tuple[float, ...]:
    """Best-of-`rounds` times (ms) of each of `routes`, run in turn after one warm-up call each
    (a kernel's first call builds its plan): load from other processes then hits all alike."""
    with torch.enable_grad():
        for fn in routes:
            fn()
        best = [math.inf] * len(routes)
        for _ in range(rounds):
            for i, fn in enumerate(routes):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
        return tuple(best)


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
