"""Helpers shared by the tests (and functions that need a dotted path)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

import mixprec
from mixprec.diagnostics.casts import CastCounter


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


__all__ = ["CastCounter", "dtypes_of", "no_host_reads", "scaled_dot"]
