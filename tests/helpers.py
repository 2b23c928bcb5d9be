"""Helpers shared by the tests (and functions that need a dotted path)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec


@mixprec.float_function
def scaled_dot(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A user function made dispatchable (fp32 by default)."""
    return (q * k).sum(-1)


def dtypes_of(out: Any) -> tuple[torch.dtype, ...]:
    """The dtypes of every tensor in a (nested) op result, in order."""
    if isinstance(out, torch.Tensor):
        return (out.dtype,)
    if isinstance(out, (list, tuple)):
        return tuple(d for o in out for d in dtypes_of(o))
    return ()


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Make every host read of a tensor (what synchronises with a GPU) raise, for hot paths."""

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a host read (sync) happened in the hot path")

    names = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse))
        yield


class CastCounter(TorchDispatchMode):
    """Counts aten._to_copy calls by (source dtype -> target dtype), below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts[(args[0].dtype, kwargs.get("dtype", args[0].dtype))] += 1
        return func(*args, **kwargs)
