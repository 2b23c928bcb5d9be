"""Importable helpers for tests that need a function with a dotted path."""

from __future__ import annotations

import torch

import mixprec


@mixprec.float_function
def scaled_dot(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A user function made dispatchable (fp32 by default)."""
    return (q * k).sum(-1)
