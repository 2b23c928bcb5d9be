"""Reading a GradScaler back on the host: skip events, the last step's skip, an explanation.

Everything here reads device values, i.e. synchronises; the scaler calls it only where its
docstrings say so (``on_skip`` every ``check_every`` updates, ``last_step_skipped``,
``explain``). The hot path never does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mixprec.scaling.state import HISTORY

if TYPE_CHECKING:
    from mixprec.scaling.scaler import GradScaler

__all__ = ["SkipEvent", "explain", "last_step_skipped", "report_skips"]


@dataclass(frozen=True)
class SkipEvent:
    """One overflowing update, as reported to ``on_skip``: its index and the scale it used."""

    step: int
    scale: float
    loss_id: int = 0


def report_skips(scaler: GradScaler) -> None:
    """Call ``on_skip`` and the listeners for every overflow since the last report. One sync."""
    assert scaler._losses is not None
    steps = int(scaler._losses[0].state.steps.item())
    listeners = ([scaler._on_skip] if scaler._on_skip else []) + scaler._listeners
    for loss_id, loss in enumerate(scaler._losses):
        hist = loss.state.history.tolist()
        for step in range(max(scaler._reported_steps, steps - HISTORY), steps):
            used = hist[step % HISTORY]
            if used < 0:
                event = SkipEvent(step, -used, loss_id)
                for listener in listeners:
                    listener(event)
    scaler._reported_steps = steps


def last_step_skipped(scaler: GradScaler) -> bool:
    """See :attr:`GradScaler.last_step_skipped`. One sync (none before first use)."""
    if not scaler._enabled:
        return False
    if scaler._losses is None:  # a loaded or unpickled state, not on a device yet
        return any(
            f.get("steps", 0) > 0 and f.get("last_skip", -1) == f.get("steps", 0) - 1
            for f in scaler._pending_load or ()
        )
    # An update that overflowed recorded its own index as the last skip.
    flags = [(st.steps > 0) & (st.last_skip == st.steps - 1)
             for st in (loss.state for loss in scaler._losses)]  # fmt: skip
    return bool(torch.stack(flags).any().item())


def explain(scaler: GradScaler) -> str:
    """See :meth:`GradScaler.explain`. Reads the scale (a sync)."""
    cfg = scaler._config
    if not scaler._enabled:
        rule = "disabled (every method passes through)"
    elif cfg.dynamic:
        rule = (
            f"scale {scaler.get_scale():g}, x{cfg.growth_factor:g} after {cfg.growth_interval} "
            f"clean steps, x{cfg.backoff_factor:g} on overflow, hysteresis {cfg.hysteresis}, "
            f"min {cfg.min_scale!r}, max {cfg.max_scale!r}"
        )
    else:
        rule = f"scale {scaler.get_scale():g}, static"
    lines = [
        f"GradScaler({scaler._device!r}): {rule}",
        f"  skip_mode={scaler._skip_mode.value!r}, unscale_impl={scaler._unscale_impl!r}, "
        f"num_losses={scaler._num_losses}",
    ]
    guards = [g for g in scaler._guards.values() if g.ref() is not None]
    for guard in guards:
        lines.append(f"  {guard.owner}: {guard.mode.value}: {guard.reason}")
    if not guards:
        lines.append("  no optimizer stepped yet (scaler.skip_mode(optimizer) tells in advance)")
    lines += [f"  decided: {note}" for note in scaler._notes]
    return "\n".join(lines)
