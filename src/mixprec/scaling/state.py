"""Loss-scale state and its update: a frozen config, a tuple of device tensors, a pure function.

The update is written with tensor ops only (``torch.where``), so it never reads a value back to
the host and can be recorded in a CUDA graph. `update_scale` returns new tensors; the scaler copies
them into its persistent ones (tensor identity matters to a captured graph). `update_scale_` is the
same rule in place, for the common configuration (hysteresis 1, no ceiling): 18 small ops,
torch's fused ``_amp_update_scale_`` among them, instead of 35 (the pure function's 28 and the 7
copies into the persistent state). Its bits are the pure function's (tested); what it saves is
launch and interpreter time on every step.

The rule, per update, with ``found_inf`` the number of non-finite gradients seen this step:

    overflow:  growth_tracker = 0; hysteresis_tracker -= 1
               if hysteresis_tracker <= 0: scale = max(scale * backoff, min_scale or tiny)
    clean:     growth_tracker += 1
               if consecutive_hysteresis: hysteresis_tracker = hysteresis
               if growth_tracker == growth_interval:
                   growth_tracker = 0; hysteresis_tracker = hysteresis
                   if scale * growth is finite: scale = min(scale * growth, max_scale)

With ``hysteresis=1`` and no bounds this is exactly torch's ``_amp_update_scale_`` (same fp32
products, so the same trajectory bit for bit), except that the scale never backs off below the
smallest normal fp32 (``tiny``, 1.2e-38), where torch's reaches 0 after about 150 consecutive
overflows and can never grow again. Hysteresis follows Megatron-LM (back off only
after ``hysteresis`` overflowing steps; reset on growth) and DeepSpeed's consecutive variant
(reset on every clean step). A static scale (``dynamic=False``) never changes; overflowing steps
are still skipped.

With several losses (Apex's ``num_losses``) each loss has its own state, and an update of a
loss that did not run in the iteration (``advance=False``) records the iteration (``steps``,
``history``) but leaves its scale and trackers alone: as Apex, whose per-loss scaler moved only
when that loss's ``scale_loss`` block ran, a loss used every k-th iteration grows its scale
after ``growth_interval`` of *its* iterations, not k times sooner.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mixprec.errors import MixprecError, format_options

__all__ = [
    "HISTORY",
    "ScaleConfig",
    "ScaleState",
    "ScalerConfigError",
    "checked_new_scale",
    "choice",
    "init_state",
    "is_int",
    "is_number",
    "update_scale",
    "update_scale_",
]

#: Length of the device-side ring buffer of past scales (and overflow flags).
HISTORY = 1024

_TINY = torch.finfo(torch.float32).tiny


class ScalerConfigError(MixprecError, ValueError):
    """A GradScaler argument or setting is invalid (the message names it and the valid values)."""


def is_number(value: object) -> bool:
    """A real number, not a bool (``True`` is an int to Python, and always a slip here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def choice(name: str, value: object, options: Any) -> str:
    """`value` if it is one of `options` (strings); else a ScalerConfigError with suggestions."""
    options = [str(o) for o in options]
    if isinstance(value, str) and value in options:
        return value
    msg = f"GradScaler {name}={value!r} is not valid."
    if isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), options, n=2, cutoff=0.6)
        if close:
            msg += f" Did you mean {format_options(close)}?"
    plural = name.replace("_", " ") + "s"
    raise ScalerConfigError(f"{msg} Valid {plural}: {format_options(options)}.")


def checked_new_scale(value: object) -> torch.Tensor:
    """``update(new_scale=...)``'s argument as a 0-dim fp32 tensor, or a ScalerConfigError."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or not value.is_floating_point():
            raise ScalerConfigError(
                f"update(new_scale=...) got a tensor of shape {tuple(value.shape)}, dtype "
                f"{value.dtype}, requires_grad={value.requires_grad}: it must be a float or a "
                f"1-element floating-point tensor that does not require grad."
            )
        return value.detach().to(torch.float32)
    if not (is_number(value) and 0.0 < value < math.inf):
        raise ScalerConfigError(
            f"update(new_scale={value!r}) must be a finite number > 0 or a 1-element tensor."
        )
    return torch.tensor(float(value), dtype=torch.float32)


@dataclass(frozen=True)
class ScaleConfig:
    """How the loss scale moves. Immutable; validated on construction.

    Attributes:
        growth_factor: multiply the scale by this after `growth_interval` clean steps (> 1).
        backoff_factor: multiply the scale by this on overflow (in (0, 1)).
        growth_interval: clean steps between growths (>= 1).
        hysteresis: overflowing steps tolerated before backing off (>= 1; 1 = torch).
        consecutive_hysteresis: refill the hysteresis budget on every clean step (DeepSpeed),
            instead of only on growth (Megatron).
        min_scale: the scale never backs off below this (None: no floor).
        max_scale: the scale never grows above this (None: only fp32's finite range).
        dynamic: False fixes the scale at its initial value.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float | None = None
    max_scale: float | None = None
    dynamic: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ScalerConfigError:
            return ScalerConfigError(
                f"GradScaler {name}={getattr(self, name)!r} is invalid: it must be {rule}."
            )

        if not (is_number(self.growth_factor) and self.growth_factor > 1.0):
            raise bad("growth_factor", "a number > 1.0 (2.0 doubles the scale)")
        if not (is_number(self.backoff_factor) and 0.0 < self.backoff_factor < 1.0):
            raise bad("backoff_factor", "a number in (0, 1) (0.5 halves the scale)")
        if not (is_int(self.growth_interval) and self.growth_interval >= 1):
            raise bad("growth_interval", "an int >= 1")
        if not (is_int(self.hysteresis) and self.hysteresis >= 1):
            raise bad("hysteresis", "an int >= 1 (1 backs off on every overflow, like torch)")
        for name in ("consecutive_hysteresis", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None and not (is_number(value) and 0.0 < value < math.inf):
                raise bad(name, "None or a finite number > 0")
        if (
            self.min_scale is not None
            and self.max_scale is not None
            and self.min_scale > self.max_scale
        ):
            raise ScalerConfigError(
                f"GradScaler min_scale={self.min_scale} is above max_scale={self.max_scale}; "
                f"the floor must not exceed the ceiling."
            )
        # Validated: store numbers as floats, so equal configs compare (and fingerprint) equal.
        for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))


class ScaleState(NamedTuple):
    """The device-side state of one loss scale. All fields are tensors on one device.

    Attributes:
        scale: fp32, 0-dim.
        growth_tracker: int32, 0-dim: consecutive clean steps since the last growth or overflow.
        hysteresis_tracker: int32, 0-dim: overflows left before the next backoff.
        steps: int64, 0-dim: updates so far.
        skipped: int64, 0-dim: updates that saw an overflow (their optimizer steps were skipped).
        last_skip: int64, 0-dim: the update index of the last overflow (-1: none).
        history: fp32, (HISTORY,): the scale *used* at each of the last HISTORY updates, negated
            when that update overflowed (NaN where not yet written); a ring buffer indexed by
            ``steps % HISTORY``.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    steps: torch.Tensor
    skipped: torch.Tensor
    last_skip: torch.Tensor
    history: torch.Tensor


def init_state(
    init_scale: float,
    config: ScaleConfig,
    device: torch.device | str,
    *,
    growth_tracker: int = 0,
    hysteresis_tracker: int | None = None,
    steps: int = 0,
    skipped: int = 0,
    last_skip: int = -1,
) -> ScaleState:
    """A fresh state on `device` (one host-to-device copy per field; no sync)."""

    def full(value: float | int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((), value, dtype=dtype, device=device)

    return ScaleState(
        scale=full(float(init_scale), torch.float32),
        growth_tracker=full(growth_tracker, torch.int32),
        hysteresis_tracker=full(
            config.hysteresis if hysteresis_tracker is None else hysteresis_tracker, torch.int32
        ),
        steps=full(steps, torch.int64),
        skipped=full(skipped, torch.int64),
        last_skip=full(last_skip, torch.int64),
        history=torch.full((HISTORY,), math.nan, dtype=torch.float32, device=device),
    )


def update_scale(
    state: ScaleState,
    found_inf: torch.Tensor,
    config: ScaleConfig,
    advance: bool | torch.Tensor = True,
) -> ScaleState:
    """The state after one step that saw `found_inf` non-finite gradients. Pure and sync-free.

    Args:
        state: the current state (not modified).
        found_inf: a 0-dim tensor on the state's device; any non-zero value means overflow.
        config: the growth/backoff rule.
        advance: whether the loss ran in this iteration (a bool, or a 0-dim bool tensor on the
            state's device, decided there without a sync). False records the iteration and
            keeps the scale and the trackers: a loss that did not run neither grows nor backs
            off (give it a zero `found_inf`).

    Returns:
        A new `ScaleState` (new tensors; `history` is a new tensor too).
    """
    overflow = found_inf != 0
    one = torch.ones_like(state.growth_tracker)
    zero = torch.zeros_like(state.growth_tracker)
    refill = torch.full_like(state.hysteresis_tracker, config.hysteresis)

    # History and counters record the step that just ran, with the scale it used.
    slot = torch.remainder(state.steps, HISTORY).reshape(1)
    used = torch.where(overflow, -state.scale, state.scale).reshape(1)
    history = state.history.index_copy(0, slot, used)
    steps = state.steps + 1
    skipped = state.skipped + overflow.to(state.skipped.dtype)
    last_skip = torch.where(overflow, state.steps, state.last_skip)

    if advance is False or not config.dynamic:
        return ScaleState(
            state.scale.clone(), state.growth_tracker.clone(), state.hysteresis_tracker.clone(),
            steps, skipped, last_skip, history,
        )  # fmt: skip

    # Overflow branch. Without a floor, ~150 consecutive overflows would reach 0, from which
    # no growth recovers: the smallest normal fp32 is the implicit floor.
    hyst_after = state.hysteresis_tracker - one
    backoff = state.scale * config.backoff_factor
    floor = _TINY if config.min_scale is None else config.min_scale
    backoff = torch.clamp(backoff, min=floor)
    scale_on_overflow = torch.where(hyst_after <= 0, backoff, state.scale)

    # Clean branch.
    successful = state.growth_tracker + one
    grow = successful == config.growth_interval
    grown = state.scale * config.growth_factor
    if config.max_scale is not None:
        grown = torch.clamp(grown, max=config.max_scale)
    # Never grow past fp32's range to inf (torch PR #98876).
    grown = torch.where(torch.isfinite(grown), grown, state.scale)
    scale_on_clean = torch.where(grow, grown, state.scale)
    tracker_on_clean = torch.where(grow, zero, successful)
    if config.consecutive_hysteresis:
        hyst_on_clean = refill
    else:
        hyst_on_clean = torch.where(grow, refill, state.hysteresis_tracker)

    scale = torch.where(overflow, scale_on_overflow, scale_on_clean)
    growth_tracker = torch.where(overflow, zero, tracker_on_clean)
    hysteresis_tracker = torch.where(overflow, hyst_after, hyst_on_clean)
    if isinstance(advance, torch.Tensor):  # decided on the device (per-loss agreement)
        scale = torch.where(advance, scale, state.scale)
        growth_tracker = torch.where(advance, growth_tracker, state.growth_tracker)
        hysteresis_tracker = torch.where(advance, hysteresis_tracker, state.hysteresis_tracker)
    return ScaleState(
        scale=scale,
        growth_tracker=growth_tracker,
        hysteresis_tracker=hysteresis_tracker,
        steps=steps,
        skipped=skipped,
        last_skip=last_skip,
        history=history,
    )


@functools.lru_cache(maxsize=64)
def updates_in_place(config: ScaleConfig) -> bool:
    """Whether `update_scale_` implements `config`: dynamic, hysteresis 1, no max_scale, and
    factors that fp32 holds exactly (torch's kernel multiplies by the factor as a double; the
    product of two fp32 numbers is exact in double, so only then is its rounding the same)."""
    exact = all(
        float(torch.tensor(f, dtype=torch.float32)) == f
        for f in (config.growth_factor, config.backoff_factor)
    )
    return exact and config.dynamic and config.hysteresis == 1 and config.max_scale is None


def update_scale_(state: ScaleState, found_inf: torch.Tensor, config: ScaleConfig) -> None:
    """`update_scale` (with ``advance=True``) applied to `state`'s own tensors. No sync.

    For configurations `updates_in_place` accepts; the result is bit for bit the pure
    function's. The scale and growth tracker move by torch's fused kernel (the rule is torch's
    there); the floor, the hysteresis tracker, the counters and the history follow.
    """
    overflow = found_inf.ne(0)
    scale, tracker, hyst = state.scale, state.growth_tracker, state.hysteresis_tracker
    # The history records the scale the step used, negated when it overflowed.
    used = torch.where(overflow, scale.neg(), scale).reshape(1)
    state.history.index_copy_(0, state.steps.remainder(HISTORY).reshape(1), used)
    torch.where(overflow, state.steps, state.last_skip, out=state.last_skip)
    state.skipped.add_(overflow)
    state.steps.add_(1)
    torch._amp_update_scale_(scale, tracker, found_inf.float(), config.growth_factor,
                             config.backoff_factor, config.growth_interval)  # fmt: skip
    floor = _TINY if config.min_scale is None else config.min_scale
    torch.where(overflow, scale.clamp(min=floor), scale, out=scale)
    # hysteresis 1: an overflow spends the budget; a growth (or, consecutive, any clean step)
    # refills it.
    hyst.sub_(overflow.to(hyst.dtype))
    clean = overflow.logical_not()
    refill = clean if config.consecutive_hysteresis else clean.logical_and_(tracker.eq(0))
    hyst.masked_fill_(refill, 1)
