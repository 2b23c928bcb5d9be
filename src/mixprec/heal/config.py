"""`HealConfig`: when online healing moves a module to fp32, as a frozen value with reasons.

Healing (``mixprec.initialize(..., heal=True)``, ``TrainStep(..., heal=True)``, the
integrations' ``options={'heal': True}``) watches the loss scaler's skipped steps. A module is
moved to fp32 for the rest of the run when it is named as the first overflow of `overflows`
skipped steps within `window` updates, in its *forward* (no loss scale fixes a forward value:
the forward is not scaled), or in its backward while the scale is already at or below
`grad_scale_floor` (the gradients overflow unscaled). An overflow in the gradients at a higher
scale is the scaler's business: it backs off, as designed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.errors import PolicyError, format_options
from mixprec.policy.policy import Policy

__all__ = ["HealConfig", "heal_options"]


@dataclass(frozen=True)
class HealConfig:
    """When healing moves a module to fp32 (``heal=True`` is ``HealConfig()``).

    Args:
        overflows: K: skipped steps a module must cause (as their first overflow) ...
        window: N: ... within this many optimizer updates, to be moved.
        check_every: updates between reads of the scaler's skip counters while the run is
            healthy (one host sync each, sets the scaler's ``check_every``). While a diagnosis
            runs it reads after every update.
        max_fraction: at most this fraction of the model's modules (its ``named_modules``,
            the root excluded) is moved; past it healing stops and says why. At least one
            module may always move.
        restore_scale: after a move, put the loss scale back to the value it had before the
            overflow streak (those back-offs answered an overflow no scale could fix).
        quiet: a diagnosis ends after this many updates without an overflow it could
            attribute (then the step runs compiled or captured again).
        grad_scale_floor: gradient overflows count only at a loss scale at or below this.
        watch_start: watch the run's first updates (until `quiet` pass without an overflow)
            as a diagnosis does, so a model that overflows from its first step is moved after
            `overflows` skipped steps, not after the reports that would start a diagnosis
            (their skips cost a short run its accuracy). Costs those steps run eagerly with
            the watch's reductions.
        replay: in a ``TrainStep``, run the steps a move explains again right after the move
            (their batches are copied while a diagnosis runs, with the random number
            generators' states: a replay draws its first attempt's dropout masks), so healing
            costs no update: the run follows the trajectory of a policy that kept the module
            in fp32 from the start.
            A replayed step uses the optimizer's settings at the time of the replay (an LR
            schedule stepped by your loop has moved on by up to `overflows` steps). Costs
            memory for the held batch copies (at most `overflows` per module under diagnosis)
            and a copy of each batch while a diagnosis runs. Loops that call ``backward``
            themselves cannot replay: their skipped steps stay skipped; nor can a step under
            several processes (DDP, FSDP): each rank decides its moves from its own batches,
            and a replayed step is a collective every rank would have to run.

    Raises:
        PolicyError: a value out of range (the message names it and the valid range).
    """

    overflows: int = 3
    window: int = 50
    check_every: int = 10
    max_fraction: float = 0.1
    restore_scale: bool = True
    quiet: int = 5
    grad_scale_floor: float = 1.0
    watch_start: bool = True
    replay: bool = True

    def __post_init__(self) -> None:
        for name in ("overflows", "window", "check_every", "quiet"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise PolicyError(f"HealConfig {name}={value!r} must be an int >= 1.")
        if self.overflows > self.window:
            raise PolicyError(
                f"HealConfig overflows={self.overflows} exceeds window={self.window}: a module "
                f"can never cause more overflows than there are updates in the window. Lower "
                f"overflows or widen the window."
            )
        frac = self.max_fraction
        if not (isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 < frac <= 1):
            raise PolicyError(
                f"HealConfig max_fraction={frac!r} must be a number in (0, 1] (0.1: at most a "
                f"tenth of the modules move)."
            )
        for name in ("restore_scale", "watch_start", "replay"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"HealConfig {name}={getattr(self, name)!r} must be a bool.")
        floor = self.grad_scale_floor
        if not (isinstance(floor, (int, float)) and not isinstance(floor, bool)
                and 0 < floor < math.inf):  # fmt: skip
            raise PolicyError(f"HealConfig grad_scale_floor={floor!r} must be a finite number > 0.")

    @classmethod
    def parse(cls, value: Any) -> HealConfig | None:
        """``True`` -> the defaults, ``False``/None -> off, a dict -> its fields, a config as is.

        Raises:
            PolicyError: any other value, or a dict with an unknown field.
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = [f.name for f in fields(cls)]
            bad = sorted(set(value) - set(names))
            if bad:
                raise PolicyError(
                    f"heal={{{bad[0]!r}: ...}} is not a HealConfig field. Valid: "
                    f"{format_options(names)}."
                )
            return cls(**value)
        raise PolicyError(
            f"heal={value!r} is not valid: use True (the defaults), False, a "
            f"mixprec.HealConfig, or a dict of its fields, e.g. heal={{'overflows': 2}}."
        )

    def summary(self) -> str:
        """One line: the rule in words."""
        replay = "; a TrainStep replays the steps skipped before a move" if self.replay else ""
        return (
            f"move a module to fp32 after it overflows {self.overflows}x within {self.window} "
            f"updates (at most {self.max_fraction:.0%} of modules){replay}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (checkpoints, JSON)."""
        return asdict(self)


def heal_options(
    level: str,
    low: torch.dtype,
    loss_scale: Any,
    value: Any,
    policy: Policy,
    autocast: bool,
) -> tuple[HealConfig | None, list[tuple[str, Any, str]]]:
    """Online healing's settings for an opt level (None: off), and rows for ``describe``:
    ``(name, value, reason)`` for ``heal`` and for the policy's fp32 modules.

    Both move modules to fp32 inside O1's autocast region (`mixprec.levels.keep_fp32`); a level
    without a region has nothing to leave (O0 is fp32 already; O2-O4 run low-precision weights,
    and the next layer takes low-precision inputs, so the values that overflowed would be cast
    back and overflow again).

    Raises:
        PolicyError: healing or fp32 modules asked for at a level that casts the weights.
    """
    config = HealConfig.parse(value)
    rows: list[tuple[str, Any, str]] = []
    if policy.fp32_modules:
        rows.append(("fp32 modules", "+".join(policy.fp32_modules),
                     "the policy keeps them in fp32 (autocast off inside)"))  # fmt: skip
    if level != "O0" and not autocast and (config is not None or policy.fp32_modules):
        what = "heal" if config is not None else f"fp32_modules={'+'.join(policy.fp32_modules)}"
        raise PolicyError(
            f"{what} works at O1: a module moved to fp32 leaves O1's autocast region and hands "
            f"on fp32 outputs. At {level} the weights are {dtype_name(low)} and each layer "
            f"takes {dtype_name(low)} inputs, so the values that overflowed would be cast back "
            f"and overflow again. Use opt_level='O1' (fp32 weights, autocast per op)."
        )
    if config is None:
        rows.append(("heal", None, "off (heal=True moves modules that keep overflowing to fp32)"))
        return None, rows
    if level == "O0":
        rows.append(("heal", None, "O0 trains in fp32: nothing overflows to heal"))
        return None, rows
    if not (loss_scale == "dynamic" or float(loss_scale) != 1.0):
        rows.append(("heal", "inactive", f"{dtype_name(low)} runs without a loss scaler, so no "
                     f"step is skipped and nothing is moved (bf16 has fp32's range)"))  # fmt: skip
        return config, rows
    given = "heal=True" if value is True else "set by the caller"
    rows.append(("heal", "on", f"{given}: {config.summary()}"))
    return config, rows
