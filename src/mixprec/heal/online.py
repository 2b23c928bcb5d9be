"""Online healing: a module that keeps overflowing moves to fp32 instead of the scale collapsing.

Every AMP system answers an overflow by halving the loss scale and skipping the step. When the
overflow is in a *forward* activation (a T5 feed-forward output past 65,504, attention logits at
long context, a user's ``exp``), no scale helps: the scale halves to its floor, every step is
skipped, training stalls. With ``heal=True`` mixprec does what a user would do by hand: find the
module and run it in fp32 for the rest of the run.

How, without a host sync in the hot path:

- *idle* (a healthy run): nothing is added to the step. The loss scaler already counts skipped
  steps on the device; its skip report (one sync every ``check_every`` updates, 10 by default)
  tells the `Healer` which updates were skipped. Two skips within ``window`` updates start a
  diagnosis; a lone skip is the scaler probing a higher scale, as designed.
- *diagnosis*: a `mixprec.watch_nonfinite` (``ops=True``) goes on the model: its device-side
  flags name the first module, phase and op that produced an inf/NaN in each step, and are read
  after each update while the diagnosis lasts (``TrainStep`` runs eagerly meanwhile, as with
  any watch). A module named as the first overflow of ``overflows`` steps within ``window``
  updates (across diagnoses: an overflow every few steps adds up), in its forward (or in its
  backward while the scale is already at or below ``grad_scale_floor``), moves to fp32
  (`mixprec.levels.keep_fp32`); the loss scale goes back to what it was before the streak. A
  module already in fp32 that is still named escalates to its parent (the overflow is in the
  parent's code around it). The diagnosis ends after ``quiet``
  updates without an attributable overflow; then the watch comes off, and ``TrainStep``
  rebuilds its compiled forward once (the kept modules are baked into compiled code). A run
  whose scale starts too high (the usual first few skips) gets one short diagnosis that finds
  nothing to move.
- at most ``max_fraction`` of the modules move; past it (or when the model's own forward, not a
  submodule, overflows) healing stops with a warning that says why and what to do.

Every move is a `HealMove` that says, in words, what overflowed, where, how often and what to
write to keep it without healing (``Policy().keep_fp32(...)``); the moves are saved with the
optimizer's and the TrainStep's checkpoints, and shown by ``describe``, ``explain`` and
`mixprec.AmpMetrics`. Moves are a function of the data and the seed: a run reproduces its moves.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.watch import NonFiniteEvent, watch_nonfinite, watcher_of
from mixprec.errors import MixprecError
from mixprec.heal.config import HealConfig
from mixprec.levels.keep_fp32 import Fp32Modules
from mixprec.policy.fp32_modules import escalate
from mixprec.policy.policy import Policy

__all__ = [
    "FORMAT",
    "HealCheckpointError",
    "HealMove",
    "Healer",
    "attach_healer",
    "follow_moves",
    "healer_of",
    "make_healer",
]

FORMAT = "mixprec.Healer/1"
_FP16_MAX = torch.finfo(torch.float16).max
_CASTS = frozenset({"_to_copy", "to", "copy_", "_to_dtype"})
_GRADIENT = {"input-grad": "gradient w.r.t. its input", "param-grad": "parameter gradient"}
_HEALERS: weakref.WeakKeyDictionary[Any, Healer] = weakref.WeakKeyDictionary()


def healer_of(scaler: Any) -> Healer | None:
    """The `Healer` listening to `scaler` (`mixprec.AmpMetrics` asks, to log the moves)."""
    return _HEALERS.get(scaler) if scaler is not None else None


class HealCheckpointError(MixprecError, ValueError):
    """A healing state that does not fit this run (nothing was changed)."""


@dataclass(frozen=True)
class HealMove:
    """One module moved to fp32 by healing, and why.

    Attributes:
        module: its qualified name in the model.
        update: the optimizer update (from 0) after which it was moved.
        phase: where its overflow showed: ``'forward'``, ``'input-grad'`` or ``'param-grad'``.
        op: the aten op that produced the first inf/NaN, when known.
        kind: ``'inf'`` or ``'nan'``.
        overflows: skipped steps it caused within `window` updates (healing's K of N).
        window: N.
        max_before: the largest finite magnitude the watch checked before the first inf/NaN in
            that step (of any dtype: an fp32 intermediate may be larger than fp16's range).
        scale: the loss scale when it was moved.
        model: which model of the ``initialize`` call (0 for the first).
        escalated_from: the module named by the watch, when it was in fp32 already and its
            parent was moved instead.
    """

    module: str
    update: int
    phase: str
    op: str | None
    kind: str
    overflows: int
    window: int
    max_before: float
    scale: float
    model: int = 0
    escalated_from: str | None = None

    def __str__(self) -> str:
        op = f" (op {self.op})" if self.op else ""
        often = f"{self.overflows} skipped steps within {self.window} updates"
        if self.escalated_from is not None:
            what = (f"its submodule {self.escalated_from!r}, already in fp32, was still the "
                    f"first to produce inf/NaN{op} on {often}, so the overflow comes from "
                    f"{self.module!r}'s own code around it")  # fmt: skip
        elif self.phase == "forward":
            made = "a cast to the low dtype in its forward" if self.op in _CASTS else (
                f"its forward{op}")  # fmt: skip
            what = (f"{made} produced the first {self.kind} of {often}: a value past the low "
                    f"dtype's range (fp16 ends at {_FP16_MAX:.0f}), and no loss scale fixes a "
                    f"forward value, which is not scaled")  # fmt: skip
        else:
            what = (f"its {_GRADIENT.get(self.phase, self.phase)}{op} was the first inf/NaN of "
                    f"{often} while the loss scale was {self.scale:g}: the gradients overflow "
                    f"(nearly) unscaled, which no scale fixes")  # fmt: skip
        where = f"model {self.model}'s " if self.model else ""
        return (
            f"update {self.update}: moved {where}{self.module!r} to fp32: {what}. In fp32 it "
            f"computes (forward and backward) and hands on values in fp32's range. To keep it "
            f"without healing: policy=mixprec.Policy().keep_fp32({self.module!r})."
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain Python values (checkpoints, JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> HealMove:
        """The inverse of `as_dict`.

        Raises:
            HealCheckpointError: not a dict of `HealMove`'s fields.
        """
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not isinstance(data, dict) or not required <= set(data) or set(data) - names:
            raise HealCheckpointError(
                f"a healing move must be a dict with the fields {sorted(names)}, got {data!r}."
            )
        if not isinstance(data["module"], str) or not isinstance(data.get("model", 0), int):
            raise HealCheckpointError(f"a healing move names a module by string: {data!r}.")
        return cls(**data)


class Healer:
    """Moves modules that keep overflowing to fp32 during a run (see the module docstring).

    Made by ``initialize(..., heal=...)`` (and so by ``TrainStep`` and the integrations);
    reach it as ``optimizer.healer`` or ``step.healer``.

    Args:
        targets: ``(model, Fp32Modules)`` per model of the ``initialize`` call.
        scaler: the loss scaler whose skipped steps are watched.
        config: when to move (`HealConfig`).
        policy: the policy the run started with (the moves are added to it).

    Attributes:
        moves: every `HealMove`, oldest first.
        notes: what healing could not fix, with the reason.
        stopped: why healing stopped (its budget, an overflow outside any submodule), or None.
        diagnoses: how many diagnoses ran (each puts a watch on the model for a few steps).
        replayed: skipped steps a ``TrainStep`` ran again after the move that fixed them
            (``HealConfig.replay``).

    Costs: idle, one host sync per ``config.check_every`` updates (the scaler's skip report),
    sooner at the start and after a skip or a diagnosis: the interval starts at 1 update and
    doubles while reports find nothing (1, 2, 4, 8, then ``check_every``: 4 more syncs than a
    fixed interval); with ``watch_start`` the first updates run as a diagnosis. A forward that
    overflows from the first step costs `overflows` skipped steps before its move (about five
    without ``watch_start``), not ``check_every`` + `overflows`. During a diagnosis: eager steps
    with the watch's reductions (in the model's forward) and one sync per update.
    """

    def __init__(
        self,
        targets: Sequence[tuple[nn.Module, Fp32Modules]],
        scaler: Any,
        config: HealConfig,
        policy: Policy,
    ) -> None:
        self.config = config
        self.scaler = scaler
        self.base_policy = policy
        self.moves: list[HealMove] = []
        self.notes: list[str] = []
        self.stopped: str | None = None
        self.diagnoses = 0
        self._targets = list(targets)
        modules = sum(len([n for n, _ in m.named_modules() if n]) for m, _ in self._targets)
        self.budget = max(1, int(config.max_fraction * modules))
        self._on_change: list[Callable[[Healer], None]] = []
        self._rebuilds: list[Callable[[], Callable[[], None] | None]] = []
        self._batch: list[Any] = []  # skip events of the report being delivered
        self._recent: list[int] = []  # skipped updates while idle, within the window
        self._scale_before: float | None = None  # the scale before the current streak
        self._watches: list[watch_nonfinite] | None = None
        self._own: list[watch_nonfinite] = []  # the watches this healer opened
        self._seen: list[int] = []
        self._hits: dict[tuple[int, str], list[tuple[int, NonFiniteEvent]]] = {}
        self._last_activity = 0
        self._moved = False  # moves since the compiled forward was last rebuilt
        self._user_every = scaler.check_every
        self._idle_every = min(self._user_every, config.check_every)
        self._every = 1  # the idle interval now: 1, doubling up to _idle_every (see Costs)
        self._removers: list[Callable[[], None]] = []
        # Replay (``HealConfig.replay``, TrainStep): a copy of the batch now running, and the
        # copies of steps whose skip a counted overflow explained, by update, until a move (or
        # the window) decides them.
        self._payload: Any = None
        self._held: dict[int, Any] = {}
        self._replays: list[Any] = []
        self.replayed = 0
        self._attach()
        if config.watch_start:  # the first updates are watched (not counted as a diagnosis)
            self._start(0, count=False)

    # ------------------------------------------------------------------ wiring

    def _attach(self) -> None:
        if self._removers:
            return
        self._removers = [self.scaler.add_skip_listener(self._on_skip),
                          self.scaler.add_report_listener(self._on_report)]  # fmt: skip
        self._every = 1
        self.scaler.check_every = self._every
        _HEALERS[self.scaler] = self

    def rebind(self, scaler: Any) -> None:
        """Watch `scaler` instead: the one a ``TrainStep(scaler=...)`` put in place of the
        scaler ``initialize`` made (the old one gets its own ``check_every`` back)."""
        self._detach()
        self.scaler = scaler
        self._user_every = scaler.check_every
        self._idle_every = min(self._user_every, self.config.check_every)
        if self.stopped is None:
            self._attach()

    def _detach(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []
        self.scaler.check_every = self._user_every

    def on_change(self, callback: Callable[[Healer], None]) -> None:
        """Call ``callback(healer)`` whenever the kept modules change (a move, a load)."""
        self._on_change.append(callback)

    def add_rebuild(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once after a diagnosis that moved modules, and after a load that
        changed them: code compiled with the old forward must be rebuilt (``TrainStep`` does
        this itself; a model you compiled yourself needs ``torch.compile`` again). A bound
        method is held weakly (it does not keep its object alive)."""
        if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
            self._rebuilds.append(weakref.WeakMethod(callback))  # type: ignore[arg-type]
        else:
            self._rebuilds.append(lambda: callback)

    @property
    def policy(self) -> Policy:
        """The run's policy with the moved modules kept in fp32 (what ``describe`` shows)."""
        moved = [m.module for m in self.moves]
        return self.base_policy.keep_fp32(*moved) if moved else self.base_policy

    @property
    def diagnosing(self) -> bool:
        """Whether a watch is on the model now (``TrainStep`` then runs eagerly)."""
        return self._watches is not None

    @property
    def replaying(self) -> bool:
        """Whether a ``TrainStep`` should hand its batches to `hold` now: replay is on and a
        diagnosis is running (only its overflows can lead to a move)."""
        return self.config.replay and self._watches is not None and self.stopped is None

    def hold(self, payload: Any) -> None:
        """Keep `payload` (a copy of the batch a ``TrainStep`` is about to run; None after it)
        if this step's skip turns out to be one a move explains, so that it can run again.

        Cost: memory for at most ``overflows`` batches per module under diagnosis, held for
        `window` updates at most (never while idle).
        """
        self._payload = payload

    def take_replays(self) -> list[Any]:
        """The payloads of skipped steps that the last move fixed, oldest first (then empty):
        running them again gives back the updates the diagnosis cost."""
        out, self._replays = self._replays, []
        self.replayed += len(out)
        return out

    # ------------------------------------------------------------------ the scaler's reports

    def _on_skip(self, event: Any) -> None:
        self._batch.append(event)

    def _on_report(self, updates: int) -> None:
        batch, self._batch = self._batch, []
        if self.stopped is not None:
            return
        if self._watches is None:
            self._idle(batch, updates)
        else:
            self._diagnose(batch, updates)

    def _idle(self, batch: list[Any], updates: int) -> None:
        window = self.config.window
        if batch and not self._recent:
            self._scale_before = batch[0].scale
        self._recent = [
            u for u in [*self._recent, *(e.step for e in batch)] if u >= updates - window
        ]
        if len(self._recent) >= min(2, self.config.overflows):
            self._start(updates)
            return
        # Look again soon after a skip; back off while the run is healthy.
        self._every = 1 if batch else min(2 * self._every, self._idle_every)
        self.scaler.check_every = self._every

    def _start(self, updates: int, count: bool = True) -> None:
        self.diagnoses += int(count)
        self._watches, self._own = [], []
        history = max(64, self.config.window)
        for model, _ in self._targets:
            watch = watcher_of(model)
            if watch is None:  # a user's own watch is read, not replaced
                # Op checks during the model's forward only: this watch spans training steps
                # and must not leave a dispatch mode on the rest of the process.
                watch = watch_nonfinite(model, ops="forward", history=history)
                watch.__enter__()
                self._own.append(watch)
            self._watches.append(watch)
        self._seen = [w.steps for w in self._watches]
        self._last_activity = updates
        self.scaler.check_every = 1

    def _stop(self) -> None:
        for watch in self._own:
            watch.__exit__(None, None, None)
        self._watches, self._own, self._seen = None, [], []
        self._recent = []
        self._scale_before = None
        self._held.clear()  # overflows that moved nothing: their steps stay skipped
        if self._removers:  # after a move the next module often overflows soon: look early
            self._every = 1
            self.scaler.check_every = self._every
        if self._moved:
            self._moved = False
            self._fire_rebuilds()

    def _fire_rebuilds(self) -> None:
        for ref in list(self._rebuilds):
            callback = ref()
            if callback is None:
                self._rebuilds.remove(ref)
            else:
                callback()

    def _counts(self, event: NonFiniteEvent, scale: float | None) -> bool:
        if event.module is None:
            return False  # an op outside the model's modules: nothing to move
        if event.phase == "forward":
            return True
        return scale is not None and scale <= self.config.grad_scale_floor

    def _diagnose(self, batch: list[Any], updates: int) -> None:
        assert self._watches is not None
        if batch and self._scale_before is None:  # a streak that began while watched (start-up)
            self._scale_before = batch[0].scale
        scale = batch[-1].scale if batch else None
        for i, watch in enumerate(self._watches):
            fresh = [e for e in watch.events() if e.step >= self._seen[i]]
            self._seen[i] = watch.steps
            for event in fresh:
                if self._counts(event, scale):
                    key = (i, event.module or "")
                    self._hits.setdefault(key, []).append((updates, event))
                    self._last_activity = updates
                    if self._payload is not None:
                        self._held[updates] = self._payload
        window = self.config.window
        for old in [u for u in self._held if u <= updates - window]:
            del self._held[old]
        for key in list(self._hits):
            hits = [h for h in self._hits.get(key, []) if h[0] > updates - window]
            self._hits[key] = hits
            if len(hits) >= self.config.overflows:
                del self._hits[key]
                self._move(key, hits, updates, scale)
                if self.stopped is not None:
                    return
        if updates - self._last_activity >= self.config.quiet:
            self._stop()

    # ------------------------------------------------------------------ moving

    def _move(self, key: tuple[int, str], hits: list[tuple[int, NonFiniteEvent]], updates: int,
              scale: float | None) -> None:  # fmt: skip
        index, name = key
        model, fp32 = self._targets[index]
        kept = fp32.names
        event = hits[-1][1]
        target, up = escalate(model, name, kept)
        escalated = name if up else None
        if not target:
            op = f" in op {event.op}" if event.op else ""
            where = (f"the model's own forward (outside its submodules){op}" if escalated is None
                     else f"{escalated!r} although it runs in fp32")  # fmt: skip
            self._give_up(
                f"update {updates}: the first inf/NaN of {len(hits)} skipped steps is in "
                f"{where}; moving a submodule cannot fix it. Put that code in a submodule (or a "
                f"function decorated with @mixprec.float_function) so healing can move it, or "
                f"look for an invalid operation (0/0, log of 0) if it is a NaN."
            )
            return
        if len(self.moves) >= self.budget:
            self._give_up(
                f"update {updates}: {target!r} overflowed {len(hits)}x within "
                f"{self.config.window} updates, but healing has moved {len(self.moves)} modules, "
                f"its budget (max_fraction={self.config.max_fraction:g} of the modules). Moving "
                f"more would make the run mostly fp32: train in bf16 (fp32's range), or raise "
                f"HealConfig(max_fraction=...) if you accept it."
            )
            return
        move = HealMove(
            module=target, update=updates, phase=event.phase, op=event.op, kind=event.kind,
            overflows=len(hits), window=self.config.window, max_before=float(event.max_before),
            scale=float(scale) if scale is not None else 0.0, model=index,
            escalated_from=escalated,
        )  # fmt: skip
        names = [n for n in kept if not n.startswith(target + ".")] + [target]
        fp32.set(names, {target: str(move)})
        self.moves.append(move)
        for update, _ in hits:  # the steps this move would have saved run again (TrainStep)
            if update in self._held:
                self._replays.append(self._held.pop(update))
        self._hits = {k: v for k, v in self._hits.items()
                      if not (k[0] == index and (k[1] == target
                                                 or k[1].startswith(target + ".")))}  # fmt: skip
        self._last_activity = updates
        self._moved = True
        if self.config.restore_scale and self._scale_before is not None:
            self._restore_scale(self._scale_before)
        self._changed()

    def _restore_scale(self, value: float) -> None:
        # Raise the scale back (never lower it), on the device: no sync.
        for loss in self.scaler._losses or ():
            loss.state.scale.clamp_(min=value)

    def _give_up(self, why: str) -> None:
        self._held.clear()
        self._replays.clear()
        self.stopped = why
        self.notes.append(why)
        self._stop()
        self._detach()
        warnings.warn(f"mixprec healing stopped: {why}", RuntimeWarning, stacklevel=2)

    def _changed(self) -> None:
        for callback in self._on_change:
            callback(self)

    # ------------------------------------------------------------------ reading

    def report(self) -> str:
        """Every move with its reason, and what healing could not fix, as text."""
        head = (f"healing: {len(self.moves)} module(s) moved to fp32 (budget {self.budget}), "
                f"{self.diagnoses} diagnosis(es); rule: {self.config.summary()}")  # fmt: skip
        lines = [head] + [f"  {m}" for m in self.moves]
        if self.replayed:
            lines.append(
                f"  {self.replayed} skipped step(s) run again after the move that fixed "
                f"them (TrainStep replays their batches): no update was lost to them"
            )
        if self.diagnosing:
            lines.append("  diagnosing now: a watch is on the model")
        lines += [f"  stopped: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return f"Healer(moves={[m.module for m in self.moves]}, stopped={self.stopped is not None})"

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The moves (and whether healing stopped), as plain Python values. No sync."""
        return {"format": FORMAT, "moves": [m.as_dict() for m in self.moves],
                "stopped": self.stopped}  # fmt: skip

    def check_state(self, state_dict: Any) -> list[HealMove]:
        """The moves of `state_dict` if it fits this run's models, else HealCheckpointError."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise HealCheckpointError(
                f"not a healing state (format {FORMAT!r} expected), got "
                f"{type(state_dict).__name__}."
            )
        moves = [HealMove.from_dict(m) for m in state_dict.get("moves") or ()]
        stopped = state_dict.get("stopped")
        if stopped is not None and not isinstance(stopped, str):
            raise HealCheckpointError(
                f"the healing state's 'stopped' must be text, not {stopped!r}"
            )
        for move in moves:
            if not 0 <= move.model < len(self._targets):
                raise HealCheckpointError(
                    f"the checkpoint moved a module of model {move.model}, and this run has "
                    f"{len(self._targets)} model(s): initialize the same models."
                )
            model = self._targets[move.model][0]
            if move.module not in dict(model.named_modules()) or not move.module:
                raise HealCheckpointError(
                    f"the checkpoint moved {move.module!r} to fp32, and "
                    f"{type(model).__name__} has no such module: it was saved from another "
                    f"model."
                )
        return moves

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep exactly the checkpoint's modules in fp32 (checked first; on error nothing
        changes). Compiled forwards are rebuilt where the kept modules changed."""
        moves = self.check_state(state_dict)
        before = [(m.model, m.module) for m in self.moves]
        if self._watches is not None:
            self._moved = False
            self._stop()
        self._recent, self._scale_before, self._batch = [], None, []
        self._held.clear()
        self._replays.clear()
        for index, (_, fp32) in enumerate(self._targets):
            mine = [m for m in moves if m.model == index]
            fp32.set([m.module for m in mine], {m.module: str(m) for m in mine})
        self.moves = moves
        self.stopped = state_dict.get("stopped")
        self.notes = [self.stopped] if self.stopped else []
        self._hits.clear()
        if self.stopped is None:
            self._attach()
        else:
            self._detach()
        self._changed()
        if before != [(m.model, m.module) for m in moves]:
            self._fire_rebuilds()


def attach_healer(models: Sequence[nn.Module], optimizers: Sequence[Any], scaling: Any,
                  options: Any) -> Healer | None:  # fmt: skip
    """The `Healer` of one ``initialize`` call (None where healing does not apply: off, no
    loss scaler, not O1, no model with `Fp32Modules`), set as ``scaling.healer``; the
    optimizers' options and the models' regions follow its moves."""
    from mixprec.levels.model import amp_hooks

    targets = []
    for model in models:
        hooks = amp_hooks(model)
        if hooks is not None and hooks.fp32 is not None:
            targets.append((model, hooks.fp32))
    healer = make_healer(targets, scaling.scaler, options)
    if healer is None:
        return None
    follow_moves(healer, optimizers, [amp_hooks(m) for m, _ in targets])
    scaling.healer = healer
    return healer


def make_healer(targets: Sequence[tuple[nn.Module, Fp32Modules]], scaler: Any,
                options: Any) -> Healer | None:  # fmt: skip
    """A `Healer` for `targets`, or None where healing does not apply (off, no enabled loss
    scaler, no target)."""
    if options.heal is None or scaler is None or not scaler.is_enabled() or not targets:
        return None
    return Healer(targets, scaler, options.heal, options.policy)


def follow_moves(healer: Healer, optimizers: Sequence[Any], hooks: Sequence[Any] = ()) -> None:
    """Keep the optimizers' options (what ``describe`` prints) and the models' regions on the
    healer's policy, the moves included."""
    opts, hooks = list(optimizers), list(hooks)

    def follow(h: Healer) -> None:
        from dataclasses import replace

        policy = h.policy
        for opt in opts:
            opt.options = replace(opt.options, policy=policy)
        for hook in hooks:
            if hook is not None and hook.region is not None:
                device_type, low, _ = hook.region
                hook.region = (device_type, low, policy)

    healer.on_change(follow)
