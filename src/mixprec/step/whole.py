"""The whole training step as one compiled graph (CPU): forward, loss, backward and update.

`TrainStep` on a CPU compiles a step in two graphs (`mixprec.step.compiled`): the forward and
loss, whose backward AOTAutograd derives and the autograd engine runs, then everything after
backward. Between them the engine writes every gradient to memory in the parameter's dtype
(fp32 under O1: a conversion pass over the low-precision gradients), the update graph reads
them back, and each graph pays its own guard check and call. This module puts the step in one
graph instead: the loss's gradients are taken inside it with ``torch.autograd.grad`` (dynamo
traces that call where ``torch._dynamo.config.trace_autograd_ops`` exists: torch 2.13), so
inductor sees the backward and the update together, and fuses each gradient's conversion,
unscale, skip and optimizer update into the loop that reads it.

What runs is what the two-graph step runs: the same forward under the same policy (mixprec's
graph pass records the graph below autograd, the backward's operations included), the scaled
loss's gradients written into the same buffers (the fp32 masters' under O2), and the same
`StepUpdate` body (unscale, overflow check, clipping, the optimizer's own ``step``, the exact
skip, the scale update). Numerics: as the two-graph step's, to inductor's fusion of fp32
arithmetic (tests/test_trainstep_whole.py compares them).

When it is used: from the first step that starts with the optimizer's state in place (made by
an eager first step, or loaded from a checkpoint: a resumed run takes the uninterrupted one's
path), on a device without CUDA graphs, when torch can trace ``autograd.grad``, when the update
is one graph (no step hooks, no fused optimizer) and every trainable parameter is the
optimizer's (or has its master there). The steps before it run their forward uncompiled, so
the forward is compiled once, inside the whole step. Kernel routes that replace an op (a
convolution or attention as matrix products, `mixprec.graph.routes`) are taken while the
graph is recorded, so the one graph has them too. A compile that fails, or a step that breaks
into several graphs, returns to two graphs for good, and ``explain()`` says why.

Costs: one compilation per input signature (the two-graph step's two, where it falls back after
a whole-step attempt, add dynamo's trace of the whole step); at run time, one guard check and
one call. No host-device synchronisation.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec.step.compiled import StepUpdate, own_code

__all__ = ["OneGraph", "WholeStep", "compiles", "trace_flag", "whole_kwargs"]


def trace_flag() -> str | None:
    """Why this torch cannot trace ``torch.autograd.grad`` into a graph, or None."""
    config = torch._dynamo.config
    if not hasattr(config, "trace_autograd_ops"):
        return f"torch {torch.__version__} cannot trace torch.autograd.grad into a graph"
    return None


class WholeStep:
    """Forward, loss, backward and update of one `TrainStep` as one compiled function.

    Args:
        update: the step's `StepUpdate` (its body runs inside this graph).
        loss: the step's forward and loss, ``loss(*batch) -> scalar tensor`` (uncompiled).
        model: the model whose trainable parameters the loss is differentiated for.
        backend: the ``torch.compile`` backend, the forward's own (mixprec's graph pass under
            O1), so that its reports and kernel choices cover the whole step too.
        compile_kwargs: other ``torch.compile`` keyword arguments (``mode``, ``options``).

    Attributes:
        calls: steps run as one graph.
    """

    def __init__(
        self,
        update: StepUpdate,
        loss: Callable[..., torch.Tensor],
        model: torch.nn.Module,
        backend: Any,
        compile_kwargs: dict[str, Any],
    ) -> None:
        self.update = update
        self._loss = loss
        self.calls = 0
        self._graphs = 0
        opt = update.optimizer
        masters = {id(low): master for low, master in zip(opt._low, opt._masters, strict=True)}
        params = [p for p in model.parameters() if p.requires_grad]
        self._params = params
        # Where each parameter's gradient goes: its fp32 master's .grad under O2, else its own.
        self._targets = [masters.get(id(p), p) for p in params]
        owned = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
        self.unfit = (
            None
            if all(id(t) in owned for t in self._targets)
            else "a trainable parameter is not in the optimizer (its gradient would have no "
            "update to go to)"
        )
        self.backend = backend
        step = types.MethodType(own_code(WholeStep._step, "mixprec_trainstep_whole"), self)
        self._compiled = torch.compile(step, backend=backend, **compile_kwargs)

    @property
    def compiles(self) -> int:
        """Graphs compiled for the whole step so far (one per input signature)."""
        return self._graphs

    def __call__(self, *batch: Any) -> torch.Tensor:
        """Run the step once (compiling it on first use); the loss, detached. No host sync."""
        for target in self._targets:
            if target.grad is None:  # the buffers the graph writes into, kept between steps
                target.grad = torch.empty_like(target)
        opt = self.update.optimizer
        scaler = opt.scaler
        state = flag = None
        if scaler is not None and scaler.is_enabled():
            state = scaler._losses[0].state
            flag = scaler._known_guard(opt.optimizer).flag
        before = compiles(self.backend)  # shared with the forward: count this step's own
        # The flag set and restored by hand: `config.patch` builds a context-manager class on
        # every call (about 10 us a step, 0.3% of the seed MLP's).
        config = torch._dynamo.config
        was = config.trace_autograd_ops
        config.trace_autograd_ops = True
        try:
            loss = self._compiled(state, flag, *batch)
        finally:
            config.trace_autograd_ops = was
            self._graphs += compiles(self.backend) - before
        if scaler is not None and scaler.is_enabled():
            scaler.note_update()
        if getattr(opt.step, "_wrapped_by_lr_sched", False):
            opt._opt_called = True  # type: ignore[attr-defined]
        self.calls += 1
        return loss

    def _step(self, state: Any, flag: torch.Tensor | None, *batch: Any) -> torch.Tensor:
        loss = self._loss(*batch)
        scaled = loss * state.scale if state is not None else loss
        grads = torch.autograd.grad(scaled, self._params)
        with torch.no_grad():
            for target, grad in zip(self._targets, grads, strict=True):
                target.grad.copy_(grad)
        self.update._update(state, flag)
        return loss.detach()


def whole_kwargs(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``torch.compile`` keywords of a whole step: the forward's, less mixprec's own keys
    (the backend is the forward's), with the update graph's narrower fusion search (its many
    parameters' loops read the same few scalars; see `UPDATE_INDUCTOR_OPTIONS`)."""
    from mixprec.step.compiled import UPDATE_INDUCTOR_OPTIONS

    kwargs = {k: v for k, v in compile_kwargs.items() if k not in ("backend", "casts", "kernels")}
    kwargs.setdefault("dynamic", False)
    if compile_kwargs.get("backend", "inductor") == "inductor" and not kwargs.get("mode"):
        kwargs["options"] = {**UPDATE_INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}
    return kwargs


def compiles(backend: Any) -> int:
    """Graphs `backend` (an `AmpBackend` or a `CountingBackend`) compiled so far."""
    reports = getattr(backend, "reports", None)
    return len(reports) if reports is not None else backend.compiles


class OneGraph:
    """Whether a `TrainStep`'s step runs as one graph, and the `WholeStep` that runs it.

    Args:
        off: why the step can never be one graph (a setting, the device, the torch version),
            or None.

    Attributes:
        off: why the step is not one graph (now or for good), or None.
        whole: the `WholeStep`, once built.
        update_ran: the compiled update ran in the last step (two graphs or one).
        last: the last step ran as one graph.
    """

    def __init__(self, off: str | None) -> None:
        self.off = off
        self.whole: WholeStep | None = None
        self.update_ran = False
        self.last = False

    def pending(self) -> bool:
        """Whether the step may become one graph but is not yet: its forward then runs
        uncompiled (it is compiled once, inside the whole step)."""
        return self.off is None and self.whole is None

    def reset(self) -> None:
        """Forget the whole step (the forward was rebuilt): the next qualifying step builds it."""
        self.whole, self.update_ran = None, False

    def describe(self) -> str:
        """One line for ``explain()``."""
        if self.off is not None:
            return f"no: {self.off}"
        return "yes: forward, loss, backward and update, once the optimizer's state exists"

    def pick(self, step: Any, update: StepUpdate | None) -> WholeStep | None:
        """The `WholeStep` when `step` (a `TrainStep`) runs this step as one graph, else None.
        Built at the first step that qualifies: one that starts with the optimizer's state in
        place (made eagerly by a first step, or loaded, so that a resumed run takes the same
        path at the same step as the uninterrupted one)."""
        if update is None or self.off is not None:
            return None
        if not (self.update_ran or update.state_complete()):
            return None
        scaler = step.optimizer.scaler
        if scaler is not None and scaler.is_enabled():
            scaler._ensure(step._device)  # its state (made by the first scale(), or a load)
        if not step._update_allowed(update.ready()):
            return None
        if self.whole is None:
            if not isinstance(step._compile_arg, dict):
                self.off = "the step is not compiled with inductor's settings"
                return None
            backend = step.amp_backend or step._forward_backend
            user, model = step._user_loss, step.model
            whole = WholeStep(update, lambda *batch: user(model, *batch), model, backend,
                              whole_kwargs(dict(step._compile_arg)))  # fmt: skip
            if whole.unfit is not None:
                self.off = whole.unfit
                return None
            self.whole = whole
        return self.whole

    def run(self, whole: WholeStep, batch: tuple[Any, ...]) -> torch.Tensor | None:
        """One step as one graph; None (and one graph off for good, with the reason) if it
        could not be compiled, so that the caller runs the two-graph step instead."""
        before = whole.compiles
        try:
            loss = whole(*batch)
        except (torch._dynamo.exc.TorchDynamoException, RuntimeError) as err:
            if whole.calls:  # it ran before: the error is this batch's, not the compiler's
                raise
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            self.off = f"compiling the step as one graph failed ({first})"
            self.whole = None
            return None
        if whole.compiles - before > 1:
            self.off = f"the step as one graph broke into {whole.compiles - before} graphs"
            self.whole = None
        # The update ran inside it, so the optimizer's state exists: the next `pick` need not
        # walk it again (`ready` still notices a state replaced or cleared).
        self.last = self.update_ran = True
        return loss
