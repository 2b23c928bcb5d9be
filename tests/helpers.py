"""Importable helpers for tests that need a function with a dotted path."""

from __future__ import annotations

from typing import Any

import torch

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
