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


__all__ = [
    "CastCounter", "Tokens", "dtypes_of", "no_host_reads", "reset_accelerate", "scaled_dot",
]  # fmt: skip


# The integration tests' tiny regression task (Lightning, Accelerate, the Transformers Trainer):
# the same data, network and scaler settings, so each framework is checked on one problem.
INF = float("inf")
STEPS = 6
_g = torch.Generator().manual_seed(0)
X, Y = torch.randn(STEPS * 8, 8, generator=_g), torch.randn(STEPS * 8, 4, generator=_g)
SCALER = {"init_scale": 2.0**10}


def tiny_net() -> torch.nn.Module:
    """Linear -> LayerNorm -> Tanh -> Linear, seeded: every run starts from the same weights."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))  # fmt: skip


def uncompiled_step(*args: Any, **kwargs: Any) -> mixprec.TrainStep:
    """A TrainStep that runs its step uncompiled (or, given a stand-in capture backend, captures
    the uncompiled step), as CUDA does by default: for tests of the eager and captured paths on
    a CPU, where TrainStep compiles the whole step by default."""
    kwargs.setdefault("compile", False)
    return mixprec.TrainStep(*args, **kwargs)


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state: another ``mixed_precision`` needs a fresh one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class Tokens(torch.utils.data.Dataset):
    """`n` sequences of 16 random token ids below 64 (seed 2), each its own labels: the
    Transformers Trainer tests' language-modelling data."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
