"""What a `TrainStep` calls to get the loss, and what it says when a batch does not fit.

A model that raises on a batch gets one paragraph from the step, naming the module that failed,
the batch element that reached it and the layout the step assumed (``loss_fn(model(*batch[:-1]),
batch[-1])`` or ``compute_loss(model, *batch)``); the model's own error stays the ``__cause__``,
with mixprec's frames left out of its traceback.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError

__all__ = ["BatchError", "TrainStepError", "batch_message", "loss_from", "trim"]


class TrainStepError(MixprecError, RuntimeError):
    """A TrainStep was built or used in a way that cannot work (the message says how to fix it)."""


class BatchError(TrainStepError):
    """The model or the loss raised on a batch; the model's own error is the ``__cause__``."""


class _LossFn:
    """``loss_fn(model(*batch[:-1]), batch[-1])``, noting how far it got (for error messages)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.output: Any = None  # the model's output while the loss runs; None otherwise

    def __call__(self, model: nn.Module, *batch: Any) -> torch.Tensor:
        if len(batch) < 2:
            raise TrainStepError(
                f"with loss_fn, a step takes the model's inputs then the target: step(x, y); got "
                f"{len(batch)} argument(s). Use compute_loss=... for other batch layouts."
            )
        self.output = None
        self.output = out = model(*batch[:-1])
        loss = self.loss_fn(out, batch[-1])
        self.output = None  # kept only when loss_fn raised, for the message
        return loss


def loss_from(
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    compute_loss: Callable[..., torch.Tensor] | None,
) -> Callable[..., torch.Tensor]:
    if compute_loss is not None:
        return compute_loss
    return _LossFn(loss_fn)  # type: ignore[arg-type]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _failing_module(model: nn.Module, err: BaseException) -> tuple[str, nn.Module] | None:
    """The innermost module of `model` whose forward was running when `err` was raised."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = (names[id(owner)] or "(the model)", owner)
        tb = tb.tb_next
    return found


def batch_message(model: nn.Module, batch: tuple[Any, ...], err: BaseException,
                   user_loss: Any) -> str:  # fmt: skip
    """One paragraph: where the model failed, on which batch element, and its own error."""
    loss_fn_layout = isinstance(user_loss, _LossFn)
    roles = ["model input"] * (len(batch) - 1) + ["target"] if loss_fn_layout else []
    parts = [f"batch[{i}]{f' ({roles[i]})' if roles else ''}: {_describe(b)}"
             for i, b in enumerate(batch)]  # fmt: skip
    message = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
    output = user_loss.output if loss_fn_layout else None
    if output is not None:  # the model ran; loss_fn(output, target) raised
        user_loss.output = None
        return (
            f"the target does not fit the model's output: loss_fn raised "
            f"{type(err).__name__}: {message}. The model's output: {_describe(output)}; "
            f"the batch: {'; '.join(parts)} (the step calls loss_fn(model(*batch[:-1]), "
            f"batch[-1]))."
        )
    failing = _failing_module(model, err)
    suspect = None
    if failing is not None:  # the batch element that reached the failing module, if one did
        args = [v for k, v in _frame_of(err, failing[1]).items() if k != "self"]
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        hits = [i for i, b in enumerate(batch) if isinstance(b, torch.Tensor)
                and (any(b is a for a in args) or tuple(b.shape) in shapes)]  # fmt: skip
        suspect = hits[0] if len(hits) == 1 else None
    who = "the model"
    if failing is not None:
        name, module = failing
        text = repr(module).split("\n")[0]
        who = f"module {name!r} ({text if len(text) <= 70 else type(module).__name__})"
    first = (f"batch element {suspect} ({_describe(batch[suspect])}) does not fit the model"
             if suspect is not None else "the batch does not fit the model")  # fmt: skip
    if failing is None and not loss_fn_layout:
        first, who = "the step failed on this batch", "compute_loss"
    layout = ("the step calls loss_fn(model(*batch[:-1]), batch[-1])" if loss_fn_layout
              else "the step calls compute_loss(model, *batch)")  # fmt: skip
    return (
        f"{first}: {who} raised {type(err).__name__}: {message}. The batch: "
        f"{'; '.join(parts)}. Check the batch against what the model expects ({layout})."
    )


def _frame_of(err: BaseException, module: nn.Module) -> dict[str, Any]:
    """The local variables of `module`'s innermost frame in `err`'s traceback."""
    found: dict[str, Any] = {}
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is module:
            found = dict(tb.tb_frame.f_locals)
        tb = tb.tb_next
    return found


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the mixprec package
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")


def trim(err: BaseException) -> BaseException:
    """`err` with a traceback of the user's and torch's frames only: mixprec's step and
    autocast machinery and torch's module-call wrappers, which say nothing about the batch,
    are left out (the exception, its message and every other frame stay)."""
    kept = []
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith(_HERE) or name.endswith(_MODULE_CALL)):
            kept.append(tb)
        tb = tb.tb_next
    if not kept:
        return err
    new = None
    for t in reversed(kept):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return err.with_traceback(new)
