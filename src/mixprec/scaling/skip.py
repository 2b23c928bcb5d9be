"""Skipping an optimizer step on the device, exactly, without asking the host.

torch's GradScaler reads ``found_inf`` back to the host before every step (``.item()``), except for
fused optimizers, which receive the scale and ``found_inf`` tensors and skip inside their kernel.
mixprec keeps that fast path and adds an exact device-side skip for every other optimizer:

- ``fused``: the optimizer consumes ``grad_scale``/``found_inf`` itself (torch's protocol: the
  attributes are set for the duration of ``step()``); no copies, no sync.
- ``restore``: copy the parameters that have gradients and their ``optimizer.state`` tensors into
  persistent snapshot buffers, run ``step()`` unconditionally, then put the snapshot back where
  ``found_inf`` is set (``torch.where``): a skipped step leaves parameters and optimizer state
  bitwise unchanged, and the host never waits. Cost: one extra copy of those tensors in memory
  (kept between steps) and two extra passes over them per step.
- ``sync``: torch's way: read ``found_inf`` on the host and call ``step()`` only if it is zero.
  One host-device synchronisation per step; no memory cost.

``restore`` needs to know the state's structure before the step. The step that *creates* an
optimizer's state (its first step, or the first step of newly added parameters) therefore
decides on the host, once; a parameter that still has no state after a step that ran (SGD
without momentum keeps none) is remembered as stateless, so it costs that one sync too, not one
per step. State tensors on another device than ``found_inf`` (the CPU step
counters of non-capturable Adam with CUDA parameters) cost a synchronisation per step: pass
``capturable=True`` or ``fused=True`` to such optimizers to stay sync-free.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any

import torch

from mixprec._compat import local_tensor

__all__ = ["SkipMode", "StepGuard", "choose_mode"]


class SkipMode(str, enum.Enum):
    """How an overflowing optimizer step is skipped (see the module docstring)."""

    AUTO = "auto"
    FUSED = "fused"
    RESTORE = "restore"
    SYNC = "sync"


def choose_mode(optimizer: torch.optim.Optimizer, requested: SkipMode) -> tuple[SkipMode, str]:
    """The skip mode for `optimizer`, and why."""
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if fused and requested in (SkipMode.AUTO, SkipMode.FUSED):
        return SkipMode.FUSED, (
            f"{type(optimizer).__name__} consumes grad_scale/found_inf in its fused kernel"
        )
    if requested is SkipMode.FUSED:
        return SkipMode.RESTORE, (
            f"{type(optimizer).__name__} is not fused; skipping by snapshot-and-restore instead"
        )
    if requested is SkipMode.SYNC:
        return SkipMode.SYNC, "requested: one host sync per step, no memory cost"
    return SkipMode.RESTORE, (
        "snapshot-and-restore on the device: no host sync, one extra copy of the parameters "
        "and optimizer state in memory"
    )


def _tracked(
    optimizer: torch.optim.Optimizer, stateless: dict[int, weakref.ref]
) -> tuple[list[torch.Tensor], bool]:
    """Tensors a step may modify (params with grads, their state), and whether state is complete.

    A parameter without state is complete only if a step already ran for it (`stateless`):
    otherwise this step may create its state.
    """
    tensors: list[torch.Tensor] = []
    complete = True
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
            tensors.extend(local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor))
    return tensors, complete


class StepGuard:
    """Runs one optimizer's step so that it has no effect when ``found_inf`` is non-zero."""

    def __init__(self, mode: SkipMode, reason: str) -> None:
        self.mode = mode
        self.reason = reason
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
        """Call `run` (which calls ``optimizer.step``) under this guard's skip mode."""
        if self.mode is SkipMode.FUSED:
            # found_inf counts non-finite tensors; fused kernels skip only when it is exactly
            # 1.0 (and subtract it from their step counters), so hand them a 0/1 flag.
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = (found_inf > 0).to(found_inf.dtype)  # type: ignore[attr-defined]
            try:
                return run()
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
        if self.mode is SkipMode.SYNC:
            self.host_syncs += 1
            return None if bool(found_inf.item()) else run()
        tensors, complete = _tracked(optimizer, self._stateless)
        if not tensors:  # no gradients: the step changes nothing either way
            return run()
        if not complete or any(t.device != found_inf.device for t in tensors):
            # State is about to be created (or lives on another device): decide on the host.
            self.host_syncs += 1
            if bool(found_inf.item()):
                return None
            result = run()
            self._note_stateless(optimizer)
            return result
        self._ensure_snapshot(tensors)
        with torch.no_grad():
            torch._foreach_copy_(self._snapshot, tensors)
        result = run()
        with torch.no_grad():
            skip = found_inf != 0
            for current, saved in zip(tensors, self._snapshot, strict=True):
                current.copy_(torch.where(skip, saved, current))
        return result

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
