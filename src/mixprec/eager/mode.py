"""The torch function mode that applies a policy to every torch call, and its weight-cast cache.

One `AutocastMode` serves all mixprec regions of a thread: the outermost enabled region pushes it
onto torch's (thread-local) function-mode stack, nested regions swap its state and restore it on
exit. Keeping a single mode matters for correctness: a second mode stacked under a nested
``enabled=False`` region would still see, and cast, every call the inner one passes down.

Cost: each torch call inside a region pays one Python-level dispatch (a dict lookup, then either
a direct call or the rule). Casts are the same ``aten::_to_copy`` torch.autocast issues. There is
no host-device synchronisation anywhere in this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.eager.table import EMPTY, MISS, DispatchTable, Region, table_handle, tables

__all__ = ["AutocastMode", "find_mode"]

_FP32 = torch.float32
_MISS = MISS


class AutocastMode(TorchFunctionMode):
    """Applies the current regions' dispatch table to every torch call on this thread.

    Attributes:
        regions: the enabled (device type, low dtype, policy) triples, sorted by device type.
        cache_enabled: whether low-precision casts of fp32 leaf weights are cached.
        depth: how many mixprec regions are open on this mode.
        cache: ``id(weight) -> (weight, dtype, version, cast)``, filled by the LOWER rules
            (see ``rules._cast_one``); emptied when the outermost region exits.
        reentered: Python wrappers whose bodies are running re-entrantly (recursion guard).
    """

    def __init__(self) -> None:
        super().__init__()
        self.regions: tuple[Region, ...] = ()
        self.cache_enabled = True
        self.table: DispatchTable = EMPTY
        self.memo: dict[Any, Any] = EMPTY.memo
        self.depth = 0
        self.cache: dict[int, tuple[torch.Tensor, torch.dtype, int, torch.Tensor]] = {}
        self.reentered: list[tuple[Callable[..., Any], tuple]] = []

    def set_state(self, regions: tuple[Region, ...], cache_enabled: bool) -> None:
        """Switch to another set of enabled regions (cheap: tables are compiled once, cached)."""
        handle = table_handle(tuple((dev, dt, policy.serial) for dev, dt, policy in regions))
        self.regions = regions
        self.cache_enabled = cache_enabled
        self.table = tables()[handle]
        self.memo = self.table.memo

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rule = self.memo.get(func, _MISS)
        if rule is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if rule is _MISS:
            rule = self.table.classify(func)
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
