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

from mixprec.eager.rules import DispatchTable, Region, _convert, dispatch_table

__all__ = ["AutocastMode", "find_mode"]

_FP32 = torch.float32
_MISS = DispatchTable.MISS
_EMPTY = DispatchTable(())


class AutocastMode(TorchFunctionMode):
    """Applies the current regions' dispatch table to every torch call on this thread.

    Attributes:
        regions: the enabled (device type, low dtype, policy) triples, sorted by device type.
        cache_enabled: whether low-precision casts of fp32 leaf weights are cached.
        depth: how many mixprec regions are open on this mode.
        cache: ``(id(weight), dtype) -> (weight, version, cast)``; emptied when the outermost
            region exits.
        reentered: Python wrappers whose bodies are running re-entrantly (recursion guard).
    """

    def __init__(self) -> None:
        super().__init__()
        self.regions: tuple[Region, ...] = ()
        self.cache_enabled = True
        self.table: DispatchTable = _EMPTY
        self.memo: dict[Any, Any] = _EMPTY.memo
        self.depth = 0
        self.cache: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.reentered: list[tuple[Callable[..., Any], tuple]] = []

    def set_state(self, regions: tuple[Region, ...], cache_enabled: bool) -> None:
        """Switch to another set of enabled regions (cheap: tables are compiled once, cached)."""
        self.regions = regions
        self.cache_enabled = cache_enabled
        self.table = dispatch_table(regions) if regions else _EMPTY
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

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cast one eligible tensor, reusing the cast of an fp32 leaf weight within the region.

        Like torch.autocast, only low-precision casts of fp32 leaves that require grad are cached
        (model weights). Unlike torch, the cache is keyed by the weight *and its version
        counter*, so a weight updated in place inside a region is cast again, and nothing is
        cached while grad mode is off (a cast made under no_grad has no autograd history).
        Caching is skipped while torch.compile traces, which handles casts itself.
        """
        if (
            dtype is not _FP32
            and value.dtype is _FP32
            and value.requires_grad
            and self.cache_enabled
            and value.is_leaf
            and torch.is_grad_enabled()
            and not value._is_view()
            and not torch.compiler.is_compiling()
        ):
            key = (id(value), dtype)
            hit = self.cache.get(key)
            version = value._version
            if hit is not None and hit[0] is value and hit[1] == version:
                return hit[2]
            out = _convert(value, dtype)
            self.cache[key] = (value, version, out)
            return out
        return _convert(value, dtype)


def find_mode() -> AutocastMode | None:
    """The mixprec mode on this thread's torch function-mode stack, if a region is open."""
    stack_len = torch._C._len_torch_function_stack()
    for i in range(stack_len - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, AutocastMode):
            return mode
    return None
