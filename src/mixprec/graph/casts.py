"""The cast-minimising pass over a policy-applied graph, and the report of what each cast is for.

A graph recorded under a policy (`mixprec.graph.trace`) has one explicit cast node per cast the
eager engine makes. Looking at the whole graph at once, some of them are redundant. The pass
works in two steps, annotate then rewrite, on the aten graph *before* autograd is derived from
it, so forward and backward change together; a rewrite is judged on both.

``casts="exact"`` (the default) applies only rewrites that leave every value bit for bit as it
was, gradients included:

- ``no_op``: a cast to the dtype its input already has (``aten.to`` returns its input);
- ``cse``: two casts of the same weight (or of a value that needs no gradient) to the same
  dtype become one, as eager autocast's weight cache does;
- ``round_trip``: ``x.to(fp32).to(low)`` with ``x`` already in ``low`` is ``x`` (widening
  bf16/fp16 to fp32 is exact), when nothing else uses the fp32 value.

``casts="minimal"`` goes for the fewest bytes: it also merges casts of activations and removes
round trips through shared values (the gradients of the merged uses are then summed in the low
dtype before being converted, not after), and adds OneFlow's colouring of *gray* ops: a region
of pointwise ops that the policy passes through (their dtype follows their inputs) whose
results only ever get cast down to the low dtype runs in the low dtype, its inputs cast down,
when that moves fewer bytes (``weight * h.to(bf16)`` before a matmul, for example). Values may
change in the last bits. Ops the policy pins (``fp32``, ``fp32_output``, ``lower``,
``promote``) never move in either mode.

``casts="off"`` keeps the graph as recorded. Every mode reports, per graph, the casts and the
bytes they move before and after, and for each remaining cast the op that needs it and why.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from mixprec.dtypes import dtype_name
from mixprec.errors import PolicyError, format_options
from mixprec.graph.trace import ORIGIN
from mixprec.policy.categories import OpCategory
from mixprec.policy.entrypoints import op_name

__all__ = ["CAST_MODES", "CastReport", "CastRow", "OpRow", "minimise_casts"]

#: Values of ``casts=``: what each mode does.
CAST_MODES = {
    "exact": "remove casts that change no value (no-op casts, duplicates, low->fp32->low round "
    "trips); results are bit for bit those of the recorded graph",
    "minimal": "the fewest casts: also merge casts of activations and round trips through "
    "shared values (their gradients then add up in the low dtype), and run pass-through "
    "pointwise ops in the low dtype when all their uses cast down anyway and that moves fewer "
    "bytes (OneFlow's gray colouring); values may change in the last bits",
    "off": "keep every cast the eager engine would make",
}

_CASTS = frozenset(
    t for t in (
        torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout,
        torch.ops.prims.convert_element_type.default,
    )
)  # fmt: skip
_ALIASING = frozenset({torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout})
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CastRow:
    """One cast left in a graph: what it converts, how many bytes it writes, and why."""

    node: str
    source: str
    target: str
    bytes: int
    reason: str


@dataclass(frozen=True)
class OpRow:
    """One aten op of a graph with the policy's category and reason (for ``mixprec.explain``)."""

    node: str
    op: str
    category: str
    reason: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class CastReport:
    """What the cast pass did to one graph.

    Attributes:
        graph: the graph's index among those compiled by this backend.
        mode: the ``casts=`` mode.
        before, bytes_before: dtype-changing casts and the bytes they write, as recorded.
        after, bytes_after: the same after the pass.
        removed: casts removed, by rewrite (``no_op``, ``cse``, ``round_trip``, ``propagate``).
        casts: the remaining casts with their reasons.
        ops: every other aten op with its category and reason.
        note: why the graph was compiled without the pass (mode ``'region'``), if it was.
    """

    graph: int
    mode: str
    before: int
    bytes_before: int
    after: int = 0
    bytes_after: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    casts: list[CastRow] = field(default_factory=list)
    ops: list[OpRow] = field(default_factory=list)
    note: str = ""

    def __str__(self) -> str:
        if self.mode == "region":
            return f"graph {self.graph}: {self.note}"
        lines = [
            f"graph {self.graph} (casts={self.mode}): {self.before} casts, "
            f"{_mb(self.bytes_before)} -> {self.after} casts, {_mb(self.bytes_after)}"
            + (
                " (removed: " + ", ".join(f"{k} {v}" for k, v in sorted(self.removed.items()))
                + ")" if self.removed else ""
            )
        ]  # fmt: skip
        for row in self.casts:
            lines.append(f"  {row.node}: {row.source} -> {row.target}, {_mb(row.bytes)}: "
                         f"{row.reason}")  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Everything, as plain JSON-ready values."""
        return dataclasses.asdict(self)


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n} B"


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _nbytes(val: Any) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    n = val.numel()
    if isinstance(n, torch.SymInt):
        # A symbolic size (dynamic=True): counted at its hint. int(n) would specialise the
        # symbol, and the guard it adds recompiled the graph for every new batch size.
        hint = getattr(n.node, "hint", None)
        return (int(hint) if hint is not None else 0) * val.element_size()
    return int(n) * val.element_size()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def is_cast(node: fx.Node) -> bool:
    """Whether `node` converts one tensor's dtype (and nothing else: same device, same shape)."""
    if node.op != "call_function" or node.target not in _CASTS or not node.args:
        return False
    src, out = _val(node.args[0]), _val(node)
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    return src.device == out.device and src.dtype in _FLOATS and out.dtype in _FLOATS


def _casts(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_cast(n) and _val(n).dtype != _val(n.args[0]).dtype]


def _replace(node: fx.Node, by: fx.Node) -> None:
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)


def _erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    for n in nodes:
        if n.graph is graph and not n.users and is_cast(n):
            graph.erase_node(n)


def _grad_nodes(graph: fx.Graph, inputs_need_grad: list[bool] | None) -> set[fx.Node]:
    """The nodes whose value (may) need a gradient: downstream of a graph input that does.

    Conservative (ops that cut the graph, such as ``detach`` or integer results, still count):
    a false positive only keeps a cast the pass could have removed. Without `inputs_need_grad`
    every node counts.
    """
    nodes = list(graph.nodes)
    if inputs_need_grad is None:
        return set(nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    grad = {n for n, g in zip(placeholders, inputs_need_grad, strict=False) if g}
    for n in nodes:
        if n.op != "placeholder" and any(a in grad for a in n.all_input_nodes):
            grad.add(n)
    return grad


def _merge_ok(src: Any, exact: bool, grad: set[fx.Node]) -> bool:
    """Whether casts of `src` may be merged without changing any value, backward included.

    Merged casts of a value that needs a gradient send their gradients through one cast: they
    are summed in the low dtype and converted once, where separate casts convert each and sum
    in the source dtype. Eager autocast merges exactly one kind, casts of weights (its cache),
    so `exact` merges those and values that need no gradient.
    """
    if not exact or src not in grad:
        return True
    return isinstance(src, fx.Node) and src.op in ("placeholder", "get_attr")


def _rewrite(graph: fx.Graph, removed: dict[str, int], exact: bool, grad: set[fx.Node]) -> bool:
    changed = False
    seen: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    for node in list(graph.nodes):
        if not is_cast(node):
            continue
        src, dst = node.args[0], _val(node).dtype
        if _val(src).dtype == dst and node.target in _ALIASING:
            _replace(node, src)
            removed["no_op"] = removed.get("no_op", 0) + 1
            changed = True
            continue
        if (
            isinstance(src, fx.Node)
            and is_cast(src)
            and _val(src.args[0]).dtype == dst
            and dst in _LOW
            and _val(src).dtype in (torch.float32, torch.float64)
            and (len(src.users) == 1 or not exact or src not in grad)
        ):
            # low -> wide is exact, so wide -> low gives the original back. With other users of
            # the wide value, its gradient would be summed in the low dtype: not exact.
            origin = src.args[0]
            _replace(node, origin)
            _erase_dead(graph, [src])
            removed["round_trip"] = removed.get("round_trip", 0) + 1
            changed = True
            continue
        if not _merge_ok(src, exact, grad):
            continue
        key = (src, dst)
        first = seen.get(key)
        if first is not None:
            _replace(node, first)
            removed["cse"] = removed.get("cse", 0) + 1
            changed = True
        else:
            seen[key] = node
    return changed


def _gray(node: fx.Node, category: Callable[[str], OpCategory]) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise not in target.tags or target._schema.is_mutable:
        return False
    if "dtype" in node.kwargs:
        return False
    name = op_name(target)
    return name is not None and category(name) is OpCategory.PASSTHROUGH


def _propagate(graph: fx.Graph, category: Callable[[str], OpCategory], removed: dict) -> bool:
    """OneFlow's gray colouring: regions of pass-through pointwise ops whose results only ever
    reach casts down to one low dtype run in that dtype, when that moves fewer bytes."""
    # Colour from the consumers up: a gray node wants `low` if every user is a cast down to
    # `low` or a gray node that wants `low`.
    want: dict[fx.Node, torch.dtype] = {}
    for node in reversed(list(graph.nodes)):
        out = _val(node)
        if not (_gray(node, category) and isinstance(out, torch.Tensor)):
            continue
        if out.dtype is not torch.float32 or not node.users:
            continue
        lows = set()
        for u in node.users:
            if is_cast(u) and _val(u).dtype in _LOW:
                lows.add(_val(u).dtype)
            elif u in want:
                lows.add(want[u])
            else:
                lows = set()
                break
        if len(lows) == 1:
            want[node] = lows.pop()
    changed = False
    for region in _regions(want):
        low = want[region[0]]
        members = set(region)
        exits = [u for n in region for u in n.users if u not in members]
        entries = list(dict.fromkeys(
            a for n in region for a in n.all_input_nodes
            if a not in members and isinstance(_val(a), torch.Tensor)
            and _val(a).is_floating_point() and _val(a).dtype != low
        ))  # fmt: skip
        saved = sum(_nbytes(_val(u)) for u in exits)
        added = 0
        for a in entries:
            v = _val(a)
            if is_cast(a) and _val(a.args[0]).dtype == low:
                # It becomes a round trip (removed); so is `a` itself if only the region uses it.
                saved += _nbytes(v) if set(a.users) <= members else 0
            else:
                added += _nbytes(v) // v.element_size() * _itemsize(low)
        if saved <= added:
            continue
        position = _position(graph)
        casts: dict[fx.Node, fx.Node] = {}
        for a in entries:
            first_use = min((n for n in region if a in n.all_input_nodes), key=position)
            with graph.inserting_before(first_use):
                cast = graph.call_function(torch.ops.aten.to.dtype, (a, low))
            cast.meta["val"] = _val(a).to(low)
            casts[a] = cast
        swap = functools.partial(_swap, casts)
        for n in region:
            n.args = fx.node.map_arg(n.args, swap)
            n.kwargs = fx.node.map_arg(n.kwargs, swap)
            n.meta["val"] = _val(n).to(low)
        for u in exits:
            _replace(u, u.args[0])
        removed["propagate"] = removed.get("propagate", 0) + len(exits)
        changed = True
    return changed


def _swap(mapping: dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    return mapping.get(node, node)


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _regions(want: dict[fx.Node, torch.dtype]) -> list[list[fx.Node]]:
    """Connected groups of wanting nodes (linked producer -> consumer), same low dtype."""
    parent = {n: n for n in want}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in want:
        for u in n.users:
            if u in want and want[u] == want[n]:
                parent[root(u)] = root(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in want:
        groups.setdefault(root(n), []).append(n)
    return list(groups.values())


def minimise_casts(
    gm: fx.GraphModule,
    mode: str,
    category: Callable[[str], OpCategory],
    reason: Callable[[str], str],
    index: int = 0,
    inputs_need_grad: list[bool] | None = None,
) -> CastReport:
    """Run the pass in `mode` over `gm` in place and report (see the module docstring).

    Args:
        gm: a graph from `mixprec.graph.trace.trace_with_policy`.
        mode: ``'exact'``, ``'minimal'`` or ``'off'`` (see `CAST_MODES`).
        category: op name -> the policy's category in the graph's region.
        reason: op name -> the policy's reason for that category.
        index: the graph's number, for the report.
        inputs_need_grad: per graph input, whether it requires grad (None: assume all do).
    """
    if mode not in CAST_MODES:
        raise PolicyError(
            f"unknown casts mode {mode!r}. Valid modes: {format_options(CAST_MODES)} "
            f"(" + "; ".join(f"{k}: {v}" for k, v in CAST_MODES.items()) + ")."
        )
    graph = gm.graph
    first = _casts(graph)
    report = CastReport(index, mode, len(first), sum(_nbytes(_val(n)) for n in first))
    if mode != "off":
        grad = _grad_nodes(graph, inputs_need_grad)
        for _ in range(20):  # each round removes at least one cast; graphs converge in 2-3
            changed = _rewrite(graph, report.removed, mode == "exact", grad)
            if mode == "minimal":
                changed = _propagate(graph, category, report.removed) or changed
            if not changed:
                break
        graph.lint()
        gm.recompile()
    left = _casts(graph)
    report.after = len(left)
    report.bytes_after = sum(_nbytes(_val(n)) for n in left)
    report.casts = [_cast_row(n, category, reason) for n in left]
    report.ops = [_op_row(n, category, reason) for n in graph.nodes if _is_op(n)]
    return report


def _is_op(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and not is_cast(node)
        and isinstance(_val(node), (torch.Tensor, tuple, list))
    )


def _dtypes(values: Iterable[Any]) -> tuple[str, ...]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(dtype_name(v.dtype))
        elif isinstance(v, (tuple, list)):
            out.extend(_dtypes(v))
    return tuple(out)


def _op_row(node: fx.Node, category: Callable[[str], OpCategory], reason: Callable) -> OpRow:
    name = op_name(node.target) or str(node.target)
    return OpRow(
        node.name,
        name,
        category(name).value,
        reason(name),
        _dtypes(_val(a) for a in node.all_input_nodes),
        _dtypes([_val(node)]),
    )


def _cast_row(node: fx.Node, category: Callable[[str], OpCategory], reason: Callable) -> CastRow:
    src, out = _val(node.args[0]), _val(node)
    why = []
    for user in node.users:
        if user.op == "output":
            why.append("the graph returns it in this dtype")
            continue
        name = op_name(user.target) if user.op == "call_function" else None
        if name is None:
            why.append(f"used by {user.name}")
            continue
        cat = category(name)
        if cat is OpCategory.PASSTHROUGH:
            why.append(f"{name} follows its inputs' dtypes")
        else:
            why.append(f"input of {name} ({cat.value}: {reason(name)})")
    source, explicit = (node.meta.get("custom") or {}).get(ORIGIN, (None, False))
    if explicit:
        why = [f"an explicit cast in the model's code ({source})"]
    where = _where(node)
    origin = node.args[0]
    weight = isinstance(origin, fx.Node) and origin.op in ("placeholder", "get_attr")
    prefix = "graph input " if weight else ""
    return CastRow(
        node.name,
        prefix + dtype_name(src.dtype),
        dtype_name(out.dtype),
        _nbytes(out),
        "; ".join(dict.fromkeys(why)) + (f" [{where}]" if where else "") or "unused",
    )


_PACKAGE = os.path.dirname(os.path.dirname(__file__))


def _where(node: fx.Node) -> str:
    """``file:line`` of the model code the node was recorded for (from dynamo's stack trace),
    the innermost frame outside mixprec."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for line in reversed(trace):
        line = line.strip()
        if line.startswith("File "):
            parts = line.split('"')
            if len(parts) >= 3 and not parts[1].startswith(_PACKAGE):
                lineno = parts[2].split(",")[1].strip().removeprefix("line ")
                return f"{os.path.basename(parts[1])}:{lineno}"
    return ""
