"""Which ops of a CPU graph inductor should not decompose: where torch's own kernel is faster.

Inductor lowers most aten ops by *decomposing* them into loops it writes and fuses. For a few
backward ops on a CPU the loop it writes is far slower than the ATen kernel it replaces, and
the difference is large enough to show in a whole training step:

- ``embedding_dense_backward`` (the gradient of an embedding table) decomposes into a scatter
  with ``accumulate=True``, which inductor's C++ code runs as one atomic floating-point add per
  gradient element, the threads contending for the same rows. ATen's kernel groups the
  indices first and adds without atomics. Measured on an AMD EPYC with avx512_bf16 (2 threads,
  torch 2.13) in the GPT-like workload of ``benchmarks/cpu_step.py`` (token and position
  tables, 1,024 tokens, width 256): 0.90 ms a step as inductor's loop, 0.09 ms as ATen's kernel.

This module names those ops and builds the inductor backend that keeps them whole (inductor
then calls the ATen kernel as an extern). It changes *which kernel* computes a value, never the
value's dtype; results differ from the decomposed loop only in the order of fp32 sums (a
gradient row that several tokens share is summed in another order).

GPUs keep inductor's decompositions: its atomic adds there are fast, and fusion matters more.

How the kernel is kept: with the decomposition removed from the table handed to ``compile_fx``,
the op reaches inductor's lowering step whole, and inductor calls ATen's kernel for it, as it
does for any op it has no lowering for (its "implicit fallback"). Inductor registers that
fallback the first time it meets the op, and, when the ``CI`` environment variable is set,
refuses ops that have a decomposition somewhere (a check meant for torch's own test runs). So
mixprec registers the same fallback first, with inductor's own ``make_fallback`` and the layout
rule inductor's implicit fallback would use for a backward op (contiguous inputs). The
registration is process-wide but inert elsewhere: a compile with inductor's default table
decomposes the op before lowering ever sees it.

A cache note: torch's compiled-graph cache keys do not include the decomposition table, so a
graph compiled and cached by inductor with the table changed here (or without it) may be served
to the other; both compute the same values, only the kernel differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from mixprec.dtypes import dtype_name
from mixprec.graph.kernels import KernelChoice

__all__ = ["KEEP_WHOLE", "inductor_keeping", "keep_whole_in", "kept_whole"]

aten = torch.ops.aten

#: forward op -> (the backward op inductor should not decompose, why), on a CPU.
KEEP_WHOLE: dict[Any, tuple[Any, str]] = {
    aten.embedding.default: (
        aten.embedding_dense_backward.default,
        "torch's kernel, not inductor's loop of atomic adds (0.09 vs 0.90 ms a step for the "
        "GPT-like workload's two tables, AMD EPYC, 2 threads)",
    ),
}


def kept_whole(gm: fx.GraphModule, device_type: str, mode: str) -> list[KernelChoice]:
    """The backward ops of `gm` that inductor should leave to ATen, one choice per forward op.

    Args:
        gm: an aten-level graph whose nodes carry fake values (as the cast pass records).
        device_type: where the graph runs; only CPU graphs keep anything whole.
        mode: the `mixprec.AmpBackend` ``kernels`` mode; ``'native'`` keeps inductor's defaults.
    """
    if device_type != "cpu" or mode == "native":
        return []
    choices = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in KEEP_WHOLE:
            continue
        backward, why = KEEP_WHOLE[node.target]
        weight = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(weight, torch.Tensor):
            continue
        if len(node.args) > 4 and node.args[4]:
            continue  # sparse=True: a sparse gradient, which has no dense backward to keep
        index = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        shapes = tuple(
            tuple(int(s) for s in t.shape) for t in (weight, index) if isinstance(t, torch.Tensor)
        )
        name = str(backward).replace(".default", "")
        choices.append(
            KernelChoice(name, shapes, dtype_name(weight.dtype), "aten", None, None, why)
        )
    return choices


def inductor_keeping(
    choices: list[KernelChoice], mode: str | None, options: dict[str, Any] | None
) -> Callable[..., Any]:
    """Inductor, configured as ``torch.compile(mode=..., options=...)`` would configure it,
    with the decompositions of the ops in `choices` removed from its table."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    config = dict(torch._TorchCompileInductorWrapper(mode, options, None).config)
    table = dict(select_decomp_table())
    names = {c.op for c in choices}
    for backward, _ in KEEP_WHOLE.values():
        if str(backward).replace(".default", "") in names:
            table.pop(backward, None)
            _lower_to_aten(backward)

    def compile_keeping(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs, config_patches=config, decompositions=table)

    return compile_keeping


def _lower_to_aten(op: Any) -> None:
    """Register inductor's ATen fallback for `op` once (see the module docstring for why)."""
    from torch._inductor import lowering

    if op in lowering.lowerings:
        return
    # override_decomp: inductor's table decomposes `op`; this lowering serves only the tables
    # mixprec hands over without it. warn=False: the CI-only refusal is for torch's own tests.
    lowering.make_fallback(
        op, layout_constraint=lowering.require_contiguous, warn=False, override_decomp=True
    )


def keep_whole_in(
    inner: Any,
    backend: Any,
    gm: fx.GraphModule,
    device_type: str,
    kernels: str,
    mode: str | None,
    options: dict[str, Any] | None,
) -> tuple[Any, list[KernelChoice]]:
    """`inner` (the compiler for `gm`), or inductor keeping `gm`'s ops of `KEEP_WHOLE` whole
    when `backend` is inductor's and `gm` runs on a CPU; with the choices made."""
    if backend != "inductor":
        return inner, []
    whole = kept_whole(gm, device_type, kernels)
    return (inductor_keeping(whole, mode, options), whole) if whole else (inner, [])
