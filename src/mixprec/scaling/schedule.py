"""`SkipAwareLR`: an LR schedule that does not advance on skipped steps, without a host sync.

Accelerate, the Transformers Trainer and DeepSpeed do not step the LR schedule when the loss
scaler skipped the optimizer step: a skipped batch must leave no trace, in the parameters or in
the schedule. They learn about the skip on the host (a sync per step). ``SkipAwareLR`` wraps any
torch LR scheduler and keeps the count of *applied* steps on the device instead:

    sched = mixprec.SkipAwareLR(torch.optim.lr_scheduler.OneCycleLR(opt, ...), scaler)
    for x, y in data:
        ...
        scaler.step(opt)
        scaler.update()
        sched.step()                 # advances only if opt's step ran; no sync

How (``mode`` and ``reason`` say which applies):

- ``device``: the lr lives in a 0-dim device tensor that the optimizer reads in its kernels
  (fused optimizers, Adam/AdamW with ``capturable=True``; a float lr is converted, once). The
  schedule's values are computed ahead on the host by a private copy of the scheduler (so the
  arithmetic is the scheduler's own) into a device table, one column per applied step;
  ``step()`` adds ``1 - skipped`` to the device count and copies that column into the lr
  tensors. No host read, so it can run inside a captured graph as long as the table reaches
  (``horizon``), and a TrainStep replaying its graph reads the new lr without re-capturing.
  Cost: 4 bytes per param group per step in the table (1M steps, 2 groups: 8 MB), grown by
  doubling; one step of the scheduler copy per training step, on the host, as the scheduler
  itself would cost.
- ``host``: the optimizer reads its lr (or, for OneCycleLR/CyclicLR with ``cycle_momentum``, its
  momentum) on the host: ``step()`` reads the skip flag (one sync per step on an accelerator)
  and steps the scheduler copy only if the optimizer stepped. Without a scaler (bf16) nothing is
  ever skipped and no flag is read.

The wrapped scheduler itself is left where it was: step the wrapper instead of it.
``state_dict()`` (a sync) holds the scheduler's own state dict as of the applied count, so a
plain torch scheduler can load it too.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mixprec._compat import capturing
from mixprec.scaling.state import ScalerConfigError

__all__ = ["FORMAT", "SkipAwareLR", "reads_device_lr"]

FORMAT = "mixprec.SkipAwareLR/1"

# Optimizers whose capturable path reads a tensor lr on the device (the others call .item()).
_TENSOR_LR = (torch.optim.Adam, torch.optim.AdamW)


def reads_device_lr(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether `optimizer` reads `group`'s lr from a device tensor without a host read."""
    return bool(group.get("fused")) or bool(
        group.get("capturable") and isinstance(optimizer, _TENSOR_LR)
    )


def _innermost(optimizer: Any) -> Any:
    # mixprec.initialize's AmpOptimizer, Accelerate's AcceleratedOptimizer: `.optimizer` holds
    # the torch optimizer that actually steps (they share its param_groups).
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class _StandIn:
    """What the scheduler copy steps instead of the optimizer: its param groups, on the host."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.defaults = dict(optimizer.defaults)
        self.param_groups = [
            {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.copy(v)
             for k, v in group.items() if k != "params"} | {"params": []}
            for group in optimizer.param_groups
        ]  # fmt: skip
        self.state: dict[Any, Any] = {}
        self._opt_called = True  # torch's "scheduler.step() before optimizer.step()" check

        def step(*_a: Any, **_k: Any) -> None:
            return None

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.step = step


def _host_copy(value: Any) -> Any:
    # A scheduler copy must compute on the host: reading its values may never sync.
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_host_copy(v) for v in value)
    return value


def _schedulers(scheduler: Any) -> list[Any]:
    """`scheduler` and the schedulers nested in it (SequentialLR, ChainedScheduler)."""
    out, todo = [], [scheduler]
    while todo:
        sched = todo.pop()
        out.append(sched)
        todo += list(getattr(sched, "_schedulers", ()))
    return out


def _clone(scheduler: Any, memo: dict[int, Any] | None = None) -> Any:
    """A deep copy that shares the user's lr functions (a bound method would copy its object)."""
    memo = dict(memo or {})
    for sched in _schedulers(scheduler):
        for fn in getattr(sched, "lr_lambdas", ()):
            memo[id(fn)] = fn
    return copy.deepcopy(scheduler, memo)


def _shadow(scheduler: Any, stand_in: _StandIn) -> Any:
    """A copy of `scheduler` (nested ones included) that steps `stand_in`, not the optimizer."""
    shadow = _clone(scheduler, {id(scheduler.optimizer): stand_in})
    for sched in _schedulers(shadow):
        for key, value in vars(sched).items():
            if key != "optimizer":
                setattr(sched, key, _host_copy(value))
    return shadow


def _value(v: Any) -> Any:
    return float(v) if isinstance(v, torch.Tensor) else v  # host tensors only: no sync


class SkipAwareLR:
    """Step a torch LR scheduler only for the optimizer steps that ran. No sync (``device`` mode).

    Args:
        scheduler: any ``torch.optim.lr_scheduler.LRScheduler`` (LambdaLR, OneCycleLR,
            CosineAnnealingLR, SequentialLR, the Transformers ``get_*_schedule_with_warmup``
            schedules, ...), freshly built or loaded. Not ReduceLROnPlateau, which follows a
            metric, not the step count: step it directly.
        scaler: the `mixprec.GradScaler` whose skips to follow (or a TrainStep /
            ``initialize``'s optimizer, whose scaler is taken); None: nothing is skipped.
        horizon: schedule values computed ahead, and the initial table size. Inside a captured
            graph only the device part of ``step()`` replays: make it cover the replays.

    Attributes:
        mode: ``'device'`` or ``'host'`` (see the module docstring); reason: why.
    """

    def __init__(self, scheduler: Any, scaler: Any = None, *, horizon: int = 256) -> None:
        from mixprec.scaling.scaler import GradScaler

        lr_scheduler = torch.optim.lr_scheduler
        if isinstance(scheduler, SkipAwareLR):
            raise ScalerConfigError("this scheduler is a SkipAwareLR already; wrap it once.")
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            raise ScalerConfigError(
                "ReduceLROnPlateau changes the lr from a validation metric, not from the step "
                "count, so skipped steps do not matter to it: step it directly "
                "(scheduler.step(val_loss)), without SkipAwareLR."
            )
        if not isinstance(scheduler, lr_scheduler.LRScheduler):
            raise TypeError(
                f"SkipAwareLR wraps a torch.optim.lr_scheduler.LRScheduler, got "
                f"{type(scheduler).__name__}: build the scheduler on the optimizer first, e.g. "
                f"SkipAwareLR(torch.optim.lr_scheduler.LambdaLR(optimizer, f), scaler)."
            )
        if scaler is not None and not isinstance(scaler, GradScaler):
            inner = getattr(scaler, "scaler", False)  # TrainStep, AmpOptimizer
            if inner is not None and not isinstance(inner, GradScaler):
                raise TypeError(
                    f"SkipAwareLR needs a mixprec.GradScaler (or None), got "
                    f"{type(scaler).__module__}.{type(scaler).__name__}: torch.amp.GradScaler "
                    f"forgets its overflow flags at update(), so no schedule can follow them "
                    f"without a sync per step."
                )
            scaler = inner
        if not (isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 1):
            raise ScalerConfigError(f"SkipAwareLR horizon={horizon!r} must be an int >= 1.")
        self.scheduler = scheduler
        self.optimizer = scheduler.optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._horizon = horizon
        self._template = _shadow(scheduler, _StandIn(self.optimizer))  # as it is now
        self.mode, self.reason = self._choose_mode()
        self._restart(_clone(self._template), applied=0)

    # ------------------------------------------------------------------ set-up

    def _choose_mode(self) -> tuple[str, str]:
        inner = _innermost(self.optimizer)
        name = type(inner).__name__
        if getattr(self.scheduler, "cycle_momentum", False):
            return "host", (
                f"{type(self.scheduler).__name__} cycles the momentum too, which {name} reads "
                f"on the host: one host read of the skip flag per step"
            )
        groups = self.optimizer.param_groups
        if all(isinstance(g["lr"], torch.Tensor) for g in groups):
            return "device", "the lr is a tensor already: the schedule writes it on the device"
        if all(reads_device_lr(inner, g) for g in groups):
            return "device", (
                f"{name} reads a device lr (fused or capturable): the lr became a 0-dim device "
                f"tensor and the schedule writes it there, no host sync"
            )
        if self.scaler is None:
            return "host", "no loss scaler: no step is ever skipped, so no flag is read"
        return "host", (
            f"{name} reads its lr on the host (pass fused=True, or capturable=True for "
            f"Adam/AdamW, to keep the lr on the device): one host read of the skip flag per "
            f"step, a sync on an accelerator"
        )

    def _restart(self, lead: Any, applied: int) -> None:
        """Start counting at `applied` with `lead`, the scheduler copy at that applied step."""
        self._lead = lead
        self._base = applied  # applied steps before this restart (a loaded checkpoint's)
        self._calls = 0  # step() calls since the restart (>= the applied steps since then)
        if self.mode == "host":
            self._applied = 0  # applied steps since the restart, counted on the host
            self._write_host()
            return
        self._lag = _clone(lead)  # the copy at the last applied count read back (checkpoints)
        self._lag_at = 0
        groups = self.optimizer.param_groups
        for group in groups:
            if not isinstance(group["lr"], torch.Tensor):
                device = group["params"][0].device if group["params"] else torch.device("cpu")
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        first = groups[0]["lr"]
        # Column k: the lr of each group after k applied steps; column 0 is the lead as it is.
        self._table = torch.empty((len(groups), 0), dtype=first.dtype, device=first.device)
        self._count = torch.zeros((), dtype=torch.int64, device=first.device)
        self._extend(self._horizon)
        self._write_device()

    def _extend(self, columns: int) -> None:
        """Compute `columns` more schedule values on the host and append them to the table."""
        values = []
        for _ in range(columns):
            if values or self._table.shape[1]:
                self._lead.step()
            values.append([_value(g["lr"]) for g in self._lead.optimizer.param_groups])
        fresh = torch.tensor(values, dtype=self._table.dtype).T
        self._table = torch.cat([self._table, fresh.to(self._table.device, non_blocking=True)], 1)

    # ------------------------------------------------------------------ stepping

    def step(self) -> None:
        """Advance the schedule by one step, unless the optimizer's last step was skipped.

        Call it after ``scaler.step(optimizer)`` (before or after ``scaler.update()``).
        ``device`` mode: no host read; ``host`` mode: one (see ``reason``).
        """
        self._calls += 1
        flag = None if self.scaler is None else self.scaler.step_skipped(self.optimizer)
        if self.mode == "host":
            if flag is not None and bool(flag.item()):  # the documented sync
                return
            self._lead.step()
            self._applied += 1
            self._write_host()
            return
        size = self._table.shape[1]
        if self._calls >= size and not capturing():  # the count can reach _calls
            self._extend(size)
        if flag is None:
            self._count.add_(1)
        else:
            self._count.sub_(flag.to(self._count.device, torch.int64, non_blocking=True) - 1)
        self._write_device()

    def _write_device(self) -> None:
        # Past the table (only possible inside a graph replayed beyond `horizon`) the last
        # computed value holds; an eager step() always extends the table first.
        index = torch.clamp(self._count, max=self._table.shape[1] - 1).reshape(1)
        column = self._table.index_select(1, index)
        for row, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor):  # an optimizer.load_state_dict replaced it
                lr = group["lr"] = torch.zeros((), dtype=self._table.dtype,
                                               device=self._table.device)  # fmt: skip
            lr.copy_(column[row, 0])

    def _write_host(self) -> None:
        # Every value the scheduler manages (lr; momentum/betas when it cycles them).
        for group, mine in zip(self.optimizer.param_groups, self._lead.optimizer.param_groups,
                               strict=True):  # fmt: skip
            for key, value in mine.items():
                if key in ("params", "initial_lr") or key not in group:
                    continue
                if isinstance(group[key], torch.Tensor):
                    group[key].fill_(_value(value))
                else:
                    group[key] = _value(value)

    # ------------------------------------------------------------------ reading

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """Each param group's lr, as torch's ``get_last_lr`` (tensor lrs copied: no sync)."""
        return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                for g in self.optimizer.param_groups]  # fmt: skip

    @property
    def applied(self) -> int:
        """Steps the schedule has taken (skipped ones excluded). Syncs in ``device`` mode."""
        if self.mode == "host":
            return self._base + self._applied
        return self._base + int(self._count.item())

    def __repr__(self) -> str:
        return f"SkipAwareLR({type(self.scheduler).__name__}, mode={self.mode!r})"

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The applied count and the scheduler's state dict at it. Syncs (``device`` mode).

        ``state_dict()['scheduler']`` loads into a plain torch scheduler of the same kind.
        """
        if self.mode == "host":
            at, applied = self._lead, self._applied
        else:
            applied = int(self._count.item())
            for _ in range(applied - self._lag_at):
                self._lag.step()
            self._lag_at = applied
            at = self._lag
        return {
            "format": FORMAT,
            "applied": self._base + applied,
            "scheduler": at.state_dict(),
            # The copy's group values as they are (host tensors stay tensors: a chainable
            # schedule computes in their dtype, and a resumed run must compute the same).
            "groups": [
                {k: _host_copy(v) for k, v in g.items() if k != "params"}
                for g in at.optimizer.param_groups
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: checked first, then the lr is set from it."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise ScalerConfigError(
                f"not a SkipAwareLR state dict (format {FORMAT!r} expected); a plain torch "
                f"scheduler's state dict loads into the scheduler before wrapping it."
            )
        groups = state_dict.get("groups")
        if not isinstance(groups, list) or len(groups) != len(self.optimizer.param_groups):
            raise ScalerConfigError(
                f"the state dict has {len(groups) if isinstance(groups, list) else '?'} param "
                f"groups, this optimizer {len(self.optimizer.param_groups)}."
            )
        applied = state_dict.get("applied")
        if not (isinstance(applied, int) and not isinstance(applied, bool) and applied >= 0):
            raise ScalerConfigError(f"state_dict['applied'] = {applied!r} must be an int >= 0.")
        lead = _clone(self._template)
        lead.load_state_dict(copy.deepcopy(state_dict["scheduler"]))
        for mine, saved in zip(lead.optimizer.param_groups, groups, strict=True):
            mine.update({k: _host_copy(v) for k, v in saved.items() if k != "params"})
        self._restart(lead, applied)
