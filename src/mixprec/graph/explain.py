"""``mixprec.explain`` for a function compiled with `mixprec.compile`: the aten ops of each
captured graph with the policy's category and reason, and every cast with what it is for."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mixprec.graph.casts import CastReport

__all__ = ["CompiledReport", "explain_compiled"]


@dataclass
class CompiledReport:
    """What the graph path did, per captured graph (see `CastReport`).

    ``str(report)`` is a table; ``report.rows`` one dict per aten op; ``report.to_json()``
    everything.
    """

    graphs: list[CastReport]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One row per aten op (casts excluded): graph, node, op, category, reason, dtypes."""
        return [
            {"graph": g.graph, "node": r.node, "op": r.op, "category": r.category,
             "reason": r.reason, "inputs": list(r.inputs), "outputs": list(r.outputs)}
            for g in self.graphs for r in g.ops
        ]  # fmt: skip

    def __str__(self) -> str:
        if not self.graphs:
            return "no graph was compiled (the function ran no tensor code?)"
        out = []
        for g in self.graphs:
            out.append(str(g).splitlines()[0])
            width = max((len(r.op) for r in g.ops), default=2)
            for r in g.ops:
                dtypes = f"{','.join(r.inputs) or '-'} -> {','.join(r.outputs) or '-'}"
                out.append(f"  {r.op:<{width}}  {r.category:<11} {dtypes:<24} {r.reason}")
            out.append("  casts:" if g.casts else "  casts: none")
            out.extend(f"    {c.node}: {c.source} -> {c.target}, {c.bytes} B: {c.reason}"
                       for c in g.casts)  # fmt: skip
        return "\n".join(out)

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps([g.to_dict() for g in self.graphs], indent=1)


def explain_compiled(fn: Any, inputs: tuple, kwargs: dict, backend: Any) -> CompiledReport:
    """Run the compiled `fn` once and report the graphs its backend compiled."""
    seen = len(backend.reports)
    fn(*inputs, **kwargs)
    fresh = backend.reports[seen:]
    return CompiledReport(list(fresh or backend.reports))
