"""The torch function mode that applies a policy to every torch call, and its weight-cast cache.

One `AutocastMode` serves all mixprec regions of a thread: the outermost enabled region pushes it
onto torch's (thread-local) function-mode stack, nested regions swap its state and restore it on
exit. Keeping a single mode matters for correctness: a second mode stacked under a nested
``enabled=False`` region would still see, and cast, every call the inner one passes down.

torch's own autocast state is the switch. A mixprec region sets it exactly as
``torch.autocast`` would (see ``autocast.py``), so model code that asks
``torch.is_autocast_enabled()`` or opens ``torch.autocast(enabled=False)`` sees, and changes, the
state it expects. Before applying a rule the mode therefore reads torch's state for the region's
device: disabled means the call passes through, another dtype means the policy is applied in that
dtype, exactly as a nested ``torch.autocast`` region behaves under torch.

Cost: each torch call inside a region pays one Python-level dispatch (a dict lookup, then either
a direct call or the rule, and a check that dynamo is not tracing, about 30 ns); a call with a
rule also reads torch's autocast state (two C calls per enabled device type, about 0.4 us).
Under torch.compile the lookup is baked into the graph (`traced_rule_index`): compiled code
guards the table's identity, not each of its keys. Casts are the same ``aten::_to_copy``
torch.autocast issues. There is no host-device synchronisation anywhere in this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec._compat import dynamo_tracing
from mixprec.eager.table import (
    EMPTY,
    MISS,
    DispatchTable,
    Region,
    table_handle,
    tables,
    traced_rule_index,
)

__all__ = ["AutocastMode", "find_mode", "torch_state"]

_MISS = MISS
_enabled = torch.is_autocast_enabled
_dtype = torch.get_autocast_dtype


def torch_state(regions: tuple[Region, ...]) -> tuple[Region, ...]:
    """The regions in force under torch's current autocast state (per thread).

    A region whose device torch has switched off (``torch.autocast(enabled=False)``,
    ``torch.amp.custom_fwd(cast_inputs=...)``) is dropped; one whose dtype torch has changed
    keeps its policy in the new dtype.
    """
    out = []
    for dev, dt, policy in regions:
        if _enabled(dev):
            now = _dtype(dev)
            out.append((dev, dt, policy) if now is dt else (dev, now, policy))
    return tuple(out)


_METHOD_WRAPPER = type(torch._C.TensorBase.dtype.__get__)
_ACCESSORS = frozenset({"__get__", "__set__", "__delete__"})


def _get(table: DispatchTable, func: Any) -> Any:
    """``table.memo.get(func, MISS)``; in a dynamo trace through the table's `traced_rules`, so
    that the compiled code guards the table's identity, not every key of its memo."""
    if dynamo_tracing():
        i = traced_rule_index(table.handle, func)
        return None if i == -1 else _MISS if i == -2 else table.traced_rules[i]
    return table.memo.get(func, _MISS)


def _handle(regions: tuple[Region, ...]) -> int:
    return table_handle(tuple((dev, dt, policy.serial) for dev, dt, policy in regions))


class AutocastMode(TorchFunctionMode):
    """Applies the current regions' dispatch table to every torch call on this thread.

    Attributes:
        regions: the enabled (device type, low dtype, policy) triples, sorted by device type, as
            the mixprec regions opened them.
        table: the dispatch table of `regions`.
        depth: how many mixprec regions are open on this mode.
        cache: ``id(weight) -> (weight, dtype, version, cast)``, filled by the LOWER rules
            (see ``rules._cast_one``); emptied when the outermost region exits. Used while
            torch's autocast cache flag is on (``cache_enabled``).
        reentered: Python wrappers whose bodies are running re-entrantly (recursion guard).
    """

    def __init__(self) -> None:
        super().__init__()
        self.regions: tuple[Region, ...] = ()
        self.table: DispatchTable = EMPTY
        self.memo: dict[Any, Any] = EMPTY.memo
        self.depth = 0
        self.cache: dict[int, tuple[torch.Tensor, torch.dtype, int, torch.Tensor]] = {}
        self.reentered: list[tuple[Callable[..., Any], tuple]] = []
        # The single enabled (device, dtype) when there is exactly one (the fast state check).
        self._one: tuple[str, torch.dtype] | None = None

    def set_state(self, regions: tuple[Region, ...]) -> None:
        """Switch to another set of enabled regions (cheap: tables are compiled once, cached)."""
        self.regions = regions
        self.table = tables()[_handle(regions)]
        self.memo = self.table.memo
        self._one = (regions[0][0], regions[0][1]) if len(regions) == 1 else None

    def in_force(self) -> bool:
        """Whether torch's autocast state still matches `regions` (nothing nested changed it)."""
        one = self._one
        if one is not None:
            return _enabled(one[0]) and _dtype(one[0]) is one[1]
        return all(_enabled(dev) and _dtype(dev) is dt for dev, dt, _ in self.regions)

    def lookup(self, func: Any) -> Any:
        """The rule for `func` under torch's current state; None means pass it through."""
        rule = _get(self.table, func)
        if rule is None:
            return None
        if rule is _MISS:
            rule = self.table.classify(func)
            if rule is None:
                return None
        if self.in_force():
            return rule
        # A torch.autocast region (or torch.amp.custom_fwd) inside ours changed the state.
        table = tables()[_handle(torch_state(self.regions))]
        rule = _get(table, func)
        return table.classify(func) if rule is _MISS else rule

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if type(func) is _METHOD_WRAPPER and func.__name__ in _ACCESSORS:
            # A tensor attribute's getter or setter (x.dtype, x.shape, x.data = ...): never cast,
            # so passed on first. It must come before dynamo_tracing(): asked inside a traced
            # mode before an attribute read, dynamo (torch 2.13) handed back the previous
            # attribute's value (x.is_nested read as x.dtype), which broke
            # nn.MultiheadAttention's input checks and any code branching on attributes.
            return func(*args, **kwargs) if kwargs else func(*args)
        if dynamo_tracing():  # `_get`, written out: each call dynamo inlines costs about 1 ms
            i = traced_rule_index(self.table.handle, func)
            rule = None if i == -1 else _MISS if i == -2 else self.table.traced_rules[i]
        else:
            rule = self.memo.get(func, _MISS)
        if rule is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        one = self._one  # the common case, inlined: one device type, torch's state unchanged
        if rule is _MISS or one is None or not _enabled(one[0]) or _dtype(one[0]) is not one[1]:
            rule = self.lookup(func)
            if rule is None:
                return func(*args, **kwargs) if kwargs else func(*args)
        return rule(self, func, args, kwargs)


def find_mode() -> AutocastMode | None:
    """The mixprec mode on this thread's torch function-mode stack, if a region is open."""
    stack_len = torch._C._len_torch_function_stack()
    for i in range(stack_len - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, AutocastMode):
            return mode
    return None
