"""Skipping an optimizer step on the device, exactly, without asking the host.

torch's GradScaler reads ``found_inf`` back to the host before every step (``.item()``), except for
fused optimizers, which receive the scale and ``found_inf`` tensors and skip inside their kernel.
mixprec keeps that fast path and adds an exact device-side skip for every other optimizer:

- ``fused``: the optimizer consumes ``grad_scale``/``found_inf`` itself (torch's protocol: the
  attributes are set for the duration of ``step()``; see `mixprec.scaling.contract`); no
  copies, no sync.
- ``restore``: copy the parameters that have gradients and their ``optimizer.state`` tensors into
  persistent snapshot buffers, run ``step()`` unconditionally, then put the snapshot back where
  ``found_inf`` is set (``torch.where``): a skipped step leaves parameters and optimizer state
  bitwise unchanged, and the host never waits. Cost: one extra copy of those tensors in memory
  (kept between steps) and two extra passes over them per step.
- ``sync``: torch's way: read ``found_inf`` on the host and call ``step()`` only if it is zero.
  One host-device synchronisation per step; no memory cost.

The step that *creates* an optimizer's state (its first step, or the first step of newly added
parameters) is decided on the host, once, in ``restore`` and ``fused`` mode alike: ``restore``
has no state to restore to, and torch's fused kernels leave state they create unset when they
skip (fused SGD with momentum allocates its momentum buffers with ``torch.empty_like`` and
fills them in the kernel: a first step that overflowed left them uninitialised, and the run
ended as far as 1e34 from one that never saw the batch; torch's own scaler has the same
flaw). A skipped creating step creates no state, exactly as if the batch had never been seen.
A parameter that still has no state after a step that ran (SGD without momentum keeps none) is
remembered as stateless, so it costs that one sync too, not one per step.

State that no device-side restore can hold back makes every step of that optimizer a host
decision (one sync per step), and the guard's ``reason`` says which state: a Python number
(SparseAdam's step counter), a sparse tensor (SGD's momentum for sparse gradients), a tensor
on another device than ``found_inf`` (the CPU step counters of non-capturable Adam with CUDA
parameters: pass ``capturable=True`` or ``fused=True`` to stay sync-free).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any

import torch

from mixprec._compat import local_tensor
from mixprec.scaling.contract import (
    consumes_scale_attributes,
    refuse_closure_optimizer,
    takes_scaler_keyword,
)

__all__ = ["SkipMode", "StepGuard", "choose_mode"]


class SkipMode(str, enum.Enum):
    """How an overflowing optimizer step is skipped (see the module docstring)."""

    AUTO = "auto"
    FUSED = "fused"
    RESTORE = "restore"
    SYNC = "sync"


def choose_mode(optimizer: torch.optim.Optimizer, requested: SkipMode) -> tuple[SkipMode, str]:
    """The skip mode for `optimizer`, and why.

    Raises:
        ScalerConfigError: the optimizer can only step with a closure (LBFGS).
    """
    refuse_closure_optimizer(optimizer)
    name = type(optimizer).__name__
    if requested in (SkipMode.AUTO, SkipMode.FUSED):
        if takes_scaler_keyword(optimizer):
            return SkipMode.FUSED, (
                f"{name}.step takes grad_scaler=... (torch's older contract, which torch "
                f"deprecates): the scaler passes itself and {name} unscales and skips by its own "
                f"code, as under torch.amp.GradScaler"
            )
        if consumes_scale_attributes(optimizer):
            return SkipMode.FUSED, (
                f"{name} consumes grad_scale/found_inf in its fused kernel; the step that creates "
                f"its state is decided on the host once, because torch's fused kernels leave new "
                f"state unset when they skip"
            )
    if requested is SkipMode.FUSED:
        return SkipMode.RESTORE, (f"{name} is not fused; skipping by snapshot-and-restore instead")
    if requested is SkipMode.SYNC:
        return SkipMode.SYNC, "requested: one host sync per step, no memory cost"
    return SkipMode.RESTORE, (
        "snapshot-and-restore on the device: no host sync, one extra copy of the parameters "
        "and optimizer state in memory"
    )


def _tracked(
    optimizer: torch.optim.Optimizer, stateless: dict[int, weakref.ref], device: torch.device
) -> tuple[list[torch.Tensor], bool, str | None]:
    """Tensors a step may modify (params with grads, their state), and two verdicts.

    ``complete``: every such parameter has its state (or is known stateless: `stateless`);
    otherwise this step may create state. ``host_only``: why some state cannot be restored on
    `device` (a Python number, a sparse tensor, a tensor elsewhere), or None.
    """
    tensors: list[torch.Tensor] = []
    complete = True
    host_only = None
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            tensors.append(local_tensor(p))  # FSDP2: snapshot and restore this rank's shard
            state = optimizer.state.get(p)
            if not state:
                known = stateless.get(id(p))
                if known is None or known() is not p:
                    complete = False
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    if value.is_sparse:
                        host_only = f"{name} keeps its state {key!r} as a sparse tensor"
                    elif value.device != device:
                        host_only = (
                            f"{name} keeps its state {key!r} on {value.device} (pass "
                            f"capturable=True or fused=True to keep it on {device})"
                        )
                    tensors.append(local_tensor(value))  # FSDP2: this rank's shard
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    host_only = (
                        f"{name} keeps its state {key!r} as a Python "
                        f"{type(value).__name__}, which only the host can hold back"
                    )
    return tensors, complete, host_only


class StepGuard:
    """Runs one optimizer's step so that it has no effect when ``found_inf`` is non-zero."""

    def __init__(self, mode: SkipMode, reason: str) -> None:
        self.mode = mode
        self.reason = reason
        self.owner = ""  # the optimizer's class name, for explanations
        self.fallback: str | None = None  # why restoring cannot be exact (host decides instead)
        self.keyword = False  # the optimizer takes step(grad_scaler=...) (torch's older contract)
        self.ref: Callable[[], Any] = lambda: None  # a weak reference to the optimizer
        # 0-dim fp32 flag, 1.0 where the optimizer's last step was skipped; written in place
        # every step (captured graphs and SkipAwareLR hold it). None before the first step.
        self.flag: torch.Tensor | None = None
        self._complete_at: tuple[int, int, int] | None = None  # see _state_complete
        self._snapshot: list[torch.Tensor] = []
        # id(param) -> weakref(param): params a step ran for that kept no optimizer state.
        # (Keyed by id: tensors compare elementwise, so they cannot be set members.)
        self._stateless: dict[int, weakref.ref] = {}
        self.host_syncs = 0  # how many steps had to ask the host (state creation, host state)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: torch.Tensor,
        grad_scale: torch.Tensor | None,
        run: Callable[[], Any],
    ) -> Any:
        """Call `run` (which calls ``optimizer.step``) under this guard's skip mode.

        `found_inf` is the scaler's 0/1 overflow flag for this optimizer (a 0-dim tensor).
        """
        if self.mode is SkipMode.FUSED:
            return self._fused_step(optimizer, found_inf, grad_scale, run)
        if self.mode is SkipMode.SYNC:
            self.host_syncs += 1
            return None if bool(found_inf.item()) else run()
        if self.fallback is not None:  # restoring cannot be exact: decide on the host
            return self._host_step(optimizer, found_inf, run)
        tensors, complete, host_only = _tracked(optimizer, self._stateless, found_inf.device)
        if not tensors:  # no gradients: the step changes nothing either way
            return run()
        if host_only is not None:
            self.fallback = host_only
            self.reason = (
                f"snapshot-and-restore cannot leave this state exactly as it was: {host_only}; "
                f"so each step is decided on the host instead (one sync per step)"
            )
            return self._host_step(optimizer, found_inf, run)
        if not complete:  # state is about to be created: decide on the host, once
            return self._host_step(optimizer, found_inf, run)
        self._ensure_snapshot(tensors)
        with torch.no_grad():
            torch._foreach_copy_(self._snapshot, tensors)
        result = run()
        with torch.no_grad():
            skip = found_inf != 0
            # One kernel per tensor, written in place (no temporary the size of the tensor).
            for current, saved in zip(tensors, self._snapshot, strict=True):
                torch.where(skip, saved, current, out=current)
        return result

    def _host_step(
        self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, run: Callable[[], Any]
    ) -> Any:
        self.host_syncs += 1
        if bool(found_inf.item()):
            return None
        result = run()
        self._note_stateless(optimizer)
        return result

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: torch.Tensor,
        grad_scale: torch.Tensor | None,
        run: Callable[[], Any],
    ) -> Any:
        try:
            complete = self._state_complete(optimizer)
            if complete:
                # Fused kernels skip only when found_inf is exactly 1.0 (and subtract it from
                # their step counters): the scaler hands a 0/1 flag, never a count.
                flag = found_inf
            else:  # this step creates state: decide on the host, once (module docstring)
                self.host_syncs += 1
                if bool(found_inf.item()):
                    return None
                flag = torch.zeros_like(found_inf)
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = flag  # type: ignore[attr-defined]
            result = run()
            if not complete:
                self._note_stateless(optimizer)
            return result
        finally:
            # torch deletes both after the step, a grad_scale the user preset included.
            for name in ("grad_scale", "found_inf"):
                if name in vars(optimizer):
                    delattr(optimizer, name)

    def creates_state(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer`'s next step may create its state: a parameter with a gradient
        has none yet and is not known to keep none. That step is decided on the host (one
        sync, see the module docstring), so a CUDA graph cannot record it. Cost: as
        `_state_complete`."""
        if self.mode is SkipMode.SYNC or self.fallback is not None:
            return False  # every step asks the host: not a question of state
        return not self._state_complete(optimizer)

    def _state_complete(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter with a gradient has its state (or is known stateless).

        Cost: a pass over the parameters (about 0.15 us each), skipped once *every* parameter
        has state, while the state container, its size and the parameter count stay those of
        that check: no parameter can then create state (a new param group or a loaded state
        dict changes the key).
        """
        key = (id(optimizer.state), len(optimizer.state),
               sum(len(g["params"]) for g in optimizer.param_groups))  # fmt: skip
        if key == self._complete_at:
            return True
        everyone = True
        for group in optimizer.param_groups:
            for p in group["params"]:
                if optimizer.state.get(p):
                    continue
                everyone = False
                if p.grad is None:
                    continue
                known = self._stateless.get(id(p))
                if known is None or known() is not p:
                    return False
        if everyone:
            self._complete_at = key
        return True

    def _note_stateless(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and not optimizer.state.get(p):
                    self._stateless[id(p)] = weakref.ref(p)

    def _ensure_snapshot(self, tensors: list[torch.Tensor]) -> None:
        snap = self._snapshot
        if len(snap) == len(tensors) and all(
            s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
            for s, t in zip(snap, tensors, strict=True)
        ):
            return
        self._snapshot = [torch.empty_like(t, memory_format=torch.preserve_format) for t in tensors]

    @property
    def snapshot_bytes(self) -> int:
        """Memory held by the snapshot buffers."""
        return sum(t.numel() * t.element_size() for t in self._snapshot)
