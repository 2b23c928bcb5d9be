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

What is measured is an op *family* (matrix products, convolutions, attention), once per
process, dtype and device, at one representative size: whether a machine has 16-bit units is a
property of the machine and the family, not of each shape, and timing every distinct shape of a
ResNet-50 cost minutes of compile time where one probe per family costs a fraction of a second.
A family whose two routes are within 10% keeps the native kernel. Every decision is recorded
with the probe's timings in a `KernelChoice`, shown by `mixprec.AmpBackend.kernel_summary` and
``TrainStep.explain()``.
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

__all__ = [
    "FAMILIES",
    "HEAVY_OPS",
    "KERNEL_MODES",
    "KernelChoice",
    "choose_kernels",
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
    "auto": "measure each op family both ways on this machine (once) and keep the faster",
    "native": "always the op's own low-precision kernel (no measurement)",
    "fp32": "always compute heavy low-precision ops in fp32 on the low-precision values",
}

_LOW = (torch.bfloat16, torch.float16)
_MARGIN = 1.1  # the fp32 route must win by this factor: casts cost something the timing misses


@dataclass(frozen=True)
class KernelChoice:
    """How one heavy op of a compiled graph is computed, and why.

    Attributes:
        op: the aten op (``'aten.linear'``).
        shapes: its input shapes, as compiled.
        dtype: the low dtype the policy put it in.
        route: ``'native'`` or ``'fp32'``.
        native_ms, fp32_ms: the family probe's forward + backward times (one representative
            size per family, not this op's shapes); None when not measured.
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

        def run(route_fp32: bool) -> Any:
            def go() -> None:
                inputs = [a.detach().requires_grad_() for a in args]
                cast = [a.float() for a in inputs] if route_fp32 else inputs
                out = op(*cast, **kwargs)
                if route_fp32:
                    out = out.to(low)
                out.backward(torch.ones_like(out))

            return go

        # Timed on a thread of its own: the caller may be compiling inside an autocast region
        # (TrainStep's O1 forward), whose thread-local state would run the fp32 route in the
        # low dtype too (both routes then measure the 16-bit kernel); a new thread starts with
        # no autocast, no dispatch or function modes and gradients enabled.
        result: list[Any] = []

        def timed() -> None:
            try:
                result.append(_time_pair(run(False), run(True)))
            except BaseException as err:  # re-raised in the caller's thread
                result.append(err)

        worker = threading.Thread(target=timed, name="mixprec-kernel-probe")
        worker.start()
        worker.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        _CACHE[key] = result[0]
    return _CACHE[key]


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
