"""`AmpMetrics`: the loss scale, skipped steps and non-finite losses as metrics, read in batches.

DeepSpeed and Megatron-LM log the loss scale (and Megatron the skipped and NaN iterations) by
default; Lightning, Accelerate and the Transformers Trainer log none of it. `AmpMetrics` turns a
`GradScaler`'s device-side state into named scalars for any logger, without a host read per step:

- the scaler already keeps, on the device, the scale each update used (negated when it
  overflowed) in a 1,024-entry ring, and the counts of updates and skipped updates;
- ``record_loss(loss)`` adds one device op per step: a count of steps whose loss was inf/NaN
  (Megatron's "nan iterations");
- every `every` steps (``step()``), or when asked (``flush()``), all of it comes off the device in
  **one transfer**, i.e. one host-device sync per `every` steps, and becomes a `MetricsBatch`:
  one row per update in the batch (its loss scale, the skipped count up to it) and the totals.
  With a `watch_nonfinite` attached, each skipped update of the batch is diagnosed too (the
  watch's per-step records are read once more, only in batches that had a skip).

Metric names follow the conventions where they exist (`NAMES`): Megatron-LM's TensorBoard tag
``loss-scale`` and its console counters ("number of skipped iterations", "number of nan
iterations") by default; DeepSpeed's monitor tag ``Train/Samples/loss_scale`` with
``names="deepspeed"``. Steps are numbered like the frameworks' global step: update ``u`` (from
0) is logged at step ``u + 1``, the number of optimizer steps taken once it ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.errors import ArgumentTypeError, ArgumentValueError, format_options

__all__ = ["NAMES", "AmpMetrics", "MetricNames", "MetricsBatch"]


@dataclass(frozen=True)
class MetricNames:
    """The names `AmpMetrics` logs under.

    Attributes:
        loss_scale: the scale each update used (per step).
        skipped: updates skipped so far, cumulative (per step).
        nan: steps whose loss was inf or NaN so far, cumulative (per flush; needs ``record_loss``).
        nonfinite: the text key for where the first inf/NaN of a skipped step came from
            (loggers that take text, e.g. TensorBoard's ``add_text``).
        healed: modules moved to fp32 by healing so far (``heal=True``), a scalar at each
            move's step, with the move's explanation as text under ``healed + '/moves'``.
    """

    loss_scale: str
    skipped: str
    nan: str
    nonfinite: str
    healed: str = "fp32-modules"


#: Megatron-LM: TensorBoard tag ``loss-scale`` (``training.py``, ``log_loss_scale_to_tensorboard``);
#: the console's "number of skipped iterations" / "number of nan iterations" as tags.
#: DeepSpeed: the monitor's ``Train/Samples/loss_scale`` (``engine.py``); the engine's
#: ``skipped_steps`` counter under the same prefix. The NaN and text tags are mixprec's, in style.
NAMES: dict[str, MetricNames] = {
    "megatron": MetricNames("loss-scale", "skipped-iterations", "nan-iterations",
                            "nonfinite-source"),
    "deepspeed": MetricNames("Train/Samples/loss_scale", "Train/Samples/skipped_steps",
                             "Train/Samples/nan_steps", "Train/Samples/nonfinite_source",
                             "Train/Samples/fp32_modules"),
}  # fmt: skip

_MAX_EVERY = 1024  # the scaler's history ring: a longer batch would lose per-step scales


@dataclass(frozen=True)
class MetricsBatch:
    """What one flush read: per-step scalars, the totals, and diagnosed skips.

    Attributes:
        rows: ``(step, {name: value})`` per update in the batch, oldest first; the last row also
            carries the NaN-loss total when losses are recorded.
        events: ``(step, text)`` for each skipped update of the batch: where its first inf/NaN
            came from when a watch is attached, else the scale it used.
        totals: the latest cumulative values (skipped updates, NaN losses, the current scale).
        text_tag: the name to log `events` under (``MetricNames.nonfinite``).
        moves: ``(step, text)`` for each module healing moved to fp32 since the last flush.
        moves_tag: the name to log `moves` under (``MetricNames.healed + '/moves'``).
    """

    rows: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    events: list[tuple[int, str]] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)
    text_tag: str = NAMES["megatron"].nonfinite
    moves: list[tuple[int, str]] = field(default_factory=list)
    moves_tag: str = NAMES["megatron"].healed + "/moves"

    @property
    def last_step(self) -> int | None:
        """The step of the newest row (None for an empty batch)."""
        return self.rows[-1][0] if self.rows else None


class AmpMetrics:
    """Loss-scale telemetry from a `GradScaler`, one host-device sync per `every` steps.

    Args:
        scaler: the `mixprec.GradScaler` (or a TrainStep / ``initialize``'s optimizer / a
            `mixprec.integrations` object that has one). None: only ``record_loss`` counts.
            Pass ``initialize``'s optimizer itself rather than its scaler: it defers each
            scale update to the next ``scale_loss``, and a read runs the one still pending.
        every: steps between automatic flushes in ``step()`` (1..1024: the scaler keeps the
            last 1,024 scales, so every step of a batch is still there when it is read).
        names: ``'megatron'`` (default), ``'deepspeed'``, or a `MetricNames`.
        watch: a `mixprec.watch_nonfinite` on the model: skipped steps are diagnosed with it.
        sinks: callables given each non-empty `MetricsBatch` (a TensorBoard writer, a logger).

    Example::

        metrics = mixprec.AmpMetrics(scaler, every=100, sinks=[mixprec.TensorBoardSink("runs/x")])
        for x, y in loader:
            ...
            scaler.step(opt); scaler.update()
            metrics.record_loss(loss)        # optional: one device op, no sync
            metrics.step()                   # a host counter; every 100th call reads the device
        metrics.flush()                      # the rest

    Cost: ``record_loss`` one small kernel; ``step`` none between flushes; a flush one transfer
    of ~4 KB per loss scale (a sync), plus one read of the watch's records when the batch had a
    skipped step and a watch is attached.
    """

    def __init__(
        self,
        scaler: Any = None,
        *,
        every: int = 100,
        names: str | MetricNames = "megatron",
        watch: Any = None,
        sinks: Any = (),
    ) -> None:
        if not (isinstance(every, int) and not isinstance(every, bool) and
                1 <= every <= _MAX_EVERY):  # fmt: skip
            raise ArgumentValueError(
                f"AmpMetrics every={every!r} must be an int in 1..{_MAX_EVERY}: the scaler keeps "
                f"the last {_MAX_EVERY} scales, so a longer batch would lose steps."
            )
        if isinstance(names, str):
            if names not in NAMES:
                raise ArgumentValueError(
                    f"AmpMetrics names={names!r} is not a naming convention. Valid: "
                    f"{format_options(NAMES)}, or a mixprec.diagnostics.metrics.MetricNames."
                )
            names = NAMES[names]
        elif not isinstance(names, MetricNames):
            raise ArgumentTypeError(
                f"AmpMetrics names must be {format_options(NAMES)} or a MetricNames, got "
                f"{type(names).__name__}."
            )
        self.scaler = _scaler_of(scaler)
        self._source = scaler
        self.every = every
        self.names = names
        self.watch = watch
        self.sinks: list[Callable[[MetricsBatch], None]] = list(sinks)
        self.totals: dict[str, float] = {}
        self._read_updates = 0  # updates already turned into rows
        self._unflushed = 0  # step() calls since the last flush (host count)
        self._steps = 0  # step() calls so far (the step number when there is no scaler)
        self._nan: torch.Tensor | None = None  # device count of non-finite losses
        self._nan_row_step = 0  # the last step whose row carried that count
        self._moves_read = 0  # healing moves already logged

    def add_sink(self, sink: Callable[[MetricsBatch], None]) -> None:
        """Also hand each batch to `sink`."""
        self.sinks.append(sink)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Count the step if `loss` is inf or NaN (one device op; no sync)."""
        if not isinstance(loss, torch.Tensor):
            return
        bad = (~torch.isfinite(loss.detach())).any().to(torch.int64)
        if self._nan is None or self._nan.device != bad.device:
            self._nan = torch.zeros((), dtype=torch.int64, device=bad.device)
        self._nan.add_(bad)

    def step(self) -> MetricsBatch | None:
        """Count one optimizer step; every `every` steps, flush. No sync between flushes."""
        self._steps += 1
        self._unflushed += 1
        if self._unflushed >= self.every:
            return self.flush()
        return None

    def flush(self) -> MetricsBatch:
        """Read everything since the last flush (one sync), hand it to the sinks, return it."""
        self._unflushed = 0
        batch = self._read()
        if batch.rows or batch.events or batch.moves:
            for sink in self.sinks:
                sink(batch)
        return batch

    # ------------------------------------------------------------------ reading (one sync)

    def _read(self) -> MetricsBatch:
        names = self.names
        # initialize's optimizers defer the scale update of a finished step: run it now.
        for obj in (self._source, getattr(self._source, "optimizer", None)):
            scaling = getattr(obj, "_scaling", None)
            if scaling is not None:
                scaling.flush()
                break
        losses = None if self.scaler is None else self.scaler._losses
        parts: list[torch.Tensor] = []
        device = None
        if losses is not None:
            state = losses[0].state
            device = state.scale.device
            parts += [state.steps.double().reshape(1), state.skipped.double().reshape(1),
                      state.scale.double().reshape(1)]  # fmt: skip
            parts += [loss.state.history.double() for loss in losses]
        if self._nan is not None:
            nan = self._nan.double().reshape(1)
            parts.append(nan if device is None else nan.to(device, non_blocking=True))
        if not parts:
            return MetricsBatch(text_tag=names.nonfinite)
        values = torch.cat(parts).tolist()  # the one sync
        rows: list[tuple[int, dict[str, float]]] = []
        events: list[tuple[int, str]] = []
        totals: dict[str, float] = {}
        if losses is not None:
            steps, skipped_total, scale_now = int(values[0]), int(values[1]), values[2]
            size = losses[0].state.history.numel()
            histories = [values[3 + i * size : 3 + (i + 1) * size] for i in range(len(losses))]
            first = max(self._read_updates, steps - size)
            used = [histories[0][u % size] for u in range(first, steps)]
            skipped_before = skipped_total - sum(1 for v in used if v < 0)
            skipped_updates = []
            for u, v in zip(range(first, steps), used, strict=True):
                if math.isnan(v):  # never written (a checkpoint without history)
                    continue
                skipped_before += v < 0
                row = {names.loss_scale: abs(v), names.skipped: float(skipped_before)}
                for i in range(1, len(losses)):  # per-loss scales (num_losses > 1)
                    row[f"{names.loss_scale}/{i}"] = abs(histories[i][u % size])
                rows.append((u + 1, row))
                if v < 0:
                    skipped_updates.append((u, abs(v)))
            self._read_updates = steps
            totals[names.loss_scale] = scale_now
            totals[names.skipped] = float(skipped_total)
            events = self._diagnose(skipped_updates)
        if self._nan is not None:
            totals[names.nan] = values[-1]
            if rows:
                rows[-1][1][names.nan] = values[-1]
            elif self._steps > self._nan_row_step:
                # No scaler rows (bf16): the count's own row; none again for a step that had
                # its row (a flush at the end of training logged a partial duplicate).
                rows.append((self._steps, {names.nan: values[-1]}))
            if rows:
                self._nan_row_step = rows[-1][0]
        moves = self._moves(rows, totals)
        self.totals = totals
        return MetricsBatch(rows, events, totals, names.nonfinite, moves, names.healed + "/moves")

    def _moves(self, rows: list[tuple[int, dict[str, float]]],
               totals: dict[str, float]) -> list[tuple[int, str]]:  # fmt: skip
        """Healing's new moves (host data, no read): text rows, and the count of moved modules
        as a scalar at each move's step and in the totals."""
        from mixprec.heal.online import healer_of

        healer = healer_of(self.scaler)
        if healer is None:
            return []
        name = self.names.healed
        totals[name] = float(len(healer.moves))
        if len(healer.moves) < self._moves_read:  # a checkpoint with fewer moves was loaded
            self._moves_read = 0
        new = healer.moves[self._moves_read :]
        first = self._moves_read
        self._moves_read = len(healer.moves)
        out = []
        by_step = dict(rows)
        for i, move in enumerate(new, start=first + 1):
            step = move.update + 1
            out.append((step, str(move)))
            if step in by_step:
                by_step[step][name] = float(i)
            else:
                rows.append((step, {name: float(i)}))
        rows.sort(key=lambda r: r[0])
        return out

    def _diagnose(self, skipped: list[tuple[int, float]]) -> list[tuple[int, str]]:
        if not skipped:
            return []
        out = []
        for update, scale in skipped:
            event = None if self.watch is None else self.watch.event_at_update(update)
            text = (f"step {update + 1} skipped (loss scale {scale:g}): "
                    + (str(event).split(": ", 1)[1] if event is not None else
                       "no watch attached" if self.watch is None else
                       "the watch saw no inf/NaN in the model"))  # fmt: skip
            out.append((update + 1, text))
        return out


def _scaler_of(obj: Any) -> Any:
    """The GradScaler of `obj`, following ``.scaler`` (TrainStep, AmpOptimizer, integrations)."""
    from mixprec.scaling.scaler import GradScaler

    for _ in range(4):
        if obj is None or isinstance(obj, GradScaler):
            return obj
        if not hasattr(obj, "scaler"):
            break
        obj = obj.scaler
    raise ArgumentTypeError(
        f"AmpMetrics needs a mixprec.GradScaler (or an object that has one as .scaler, such as "
        f"a TrainStep or a mixprec.integrations precision plugin), got {type(obj).__name__}: "
        f"torch.amp.GradScaler keeps no history to read."
    )
