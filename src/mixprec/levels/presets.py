"""Opt levels O0-O3: named, frozen presets that say what they do and why each option has its value.

An opt level is a preset of Apex's options. `resolve` applies a user's overrides (Apex's names)
to a preset for a device and dtype, checks the combination, and returns an `AmpOptions` in which
every value carries the reason it was chosen; ``describe()`` prints it. Inconsistent overrides
raise an error naming the conflict, or warn when the combination works but is probably not what
was meant.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mixprec.dtypes import dtype_name, parse_device_type, parse_dtype, resolve_dtype
from mixprec.errors import (
    ArgumentTypeError,
    PolicyError,
    UsageError,
    format_options,
    unknown_value,
)
from mixprec.fp8.recipe import Fp8Recipe
from mixprec.heal.config import HealConfig, heal_options
from mixprec.policy.policy import Policy, as_policy

__all__ = ["OVERRIDES", "AmpOptions", "OptLevel", "describe", "resolve"]


class OptLevel(str, enum.Enum):
    """The four opt levels, after Apex amp."""

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"
    O4 = "O4"

    @classmethod
    def parse(cls, value: str | OptLevel) -> OptLevel:
        """Accept ``'O2'``, ``'o2'`` or ``OptLevel.O2``; list the valid levels otherwise."""
        if isinstance(value, OptLevel):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
            if key.startswith("0") and "O" + key[1:] in cls.__members__:  # '02' typed for 'O2'
                return cls["O" + key[1:]]
        # A UsageError: a PolicyError, and a RuntimeError as Apex raised for an unknown level.
        raise UsageError(
            unknown_value("opt level", value, [m.value for m in cls],
                          hint="Levels are the letter O and a digit: 'O0' ... 'O4'.")
        )  # fmt: skip


@dataclass(frozen=True)
class _Preset:
    summary: str
    description: str
    cast_model_type: str | None  # "low", "fp32" or None (leave the model's dtype alone)
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | str  # True: fp32 masters; False: none; or a low-memory weights mode
    loss_scale: str | float  # "dynamic" or a number
    cast_model_outputs: str | None  # "fp32" or None
    optimizer_states: str = "fp32"  # "fp32": the optimizer's own; or "bf16", "8bit"


PRESETS: dict[OptLevel, _Preset] = {
    OptLevel.O0: _Preset(
        "O0: pure fp32 training (the baseline).",
        "Model, activations and optimizer stay in fp32; no casts, no loss scaling. Use it to "
        "establish the accuracy the other levels must match.",
        "fp32",
        False,
        None,
        False,
        1.0,
        None,
    ),
    OptLevel.O1: _Preset(
        "O1: mixed precision by op (autocast); fp32 weights.",
        "The model's forward runs under mixprec.autocast: matmuls and convolutions in the low "
        "dtype, precision-sensitive ops in fp32, following the op policy. Weights, gradients "
        "and the optimizer stay fp32. Outputs are returned in fp32, so a loss computed on "
        "them outside the model runs in fp32 too (Apex's O1 ran its loss functions in fp32 "
        "wherever they were called). fp16 needs dynamic loss scaling; bf16 does not. The "
        "safest level, and the one torch.amp offers.",
        None,
        True,
        None,
        False,
        "dynamic",
        "fp32",
    ),
    OptLevel.O2: _Preset(
        "O2: low-precision model with fp32 normalization layers and fp32 master weights.",
        "The model's weights are cast to the low dtype, except normalization layers (BatchNorm, "
        "LayerNorm, GroupNorm, ...), which stay fp32 and compute in fp32. Floating inputs are "
        "cast at the model's entry and outputs returned in fp32. The optimizer steps on fp32 "
        "master copies of the weights, so updates smaller than the low dtype's resolution still "
        "accumulate; the low-precision weights are refreshed from them after each step. No "
        "per-step weight cast, half the weight memory traffic of O1.",
        "low",
        False,
        True,
        True,
        "dynamic",
        "fp32",
    ),
    OptLevel.O3: _Preset(
        "O3: pure low precision (the speed-of-light baseline).",
        "Every weight, normalization layers included, is in the low dtype, inputs are cast at "
        "the model's entry, and the optimizer updates the low-precision weights directly: no "
        "master weights, no loss scaling. Fastest and least accurate; updates below the low "
        "dtype's resolution are lost. Use it to see what O1/O2 could reach, not to train.",
        "low",
        False,
        False,
        False,
        1.0,
        None,
    ),
    OptLevel.O4: _Preset(
        "O4: bf16 training state at 6 bytes per parameter (AdamW), with fp32's accuracy.",
        "The model is cast as in O2 (normalization layers stay fp32), but nothing is kept in "
        "fp32 per weight: the optimizer (torch's AdamW, Adam or SGD, replaced by mixprec's "
        "LowMemAdamW/LowMemAdam/LowMemSGD with the same hyperparameters) updates the bf16 "
        "weights directly, computing in fp32 and rounding stochastically from a seeded counter "
        "hash, so updates below bf16's resolution still accumulate on average; its moments "
        "are stored in 8 bits per value, blockwise (256 values share an fp32 scale) with a "
        "quartic code, except tensors under 4096 elements, which stay fp32. Each block's "
        "scale is a bound known before the step (optimizer_states='8bit-bound': from the "
        "largest value the old codes hold and the gradient's block maximum; second moments' "
        "codes rounded stochastically), so a compiled update is one pass; "
        "optimizer_states='8bit' scales by the new values' maxima instead (finer codes, a "
        "second pass). Per parameter: "
        "weight 2 + gradient 2 + two moments 2.03 bytes, against 16 for fp32 AdamW. Overflow "
        "skips, checkpoints and TrainStep work as at every level.",
        "low",
        False,
        True,
        "stochastic",
        1.0,
        "fp32",
        "8bit-bound",
    ),
}

#: Values of ``master_weights``: how the optimizer's update reaches a low-precision weight.
MASTER_WEIGHTS = {
    "True / 'fp32'": "fp32 master copies (O2): 4 more bytes per parameter, exact",
    "'stochastic'": "bf16 weights updated with seeded stochastic rounding: no extra bytes",
    "'kahan'": "low-precision weights plus a compensation buffer of the same dtype: 2 bytes",
    "'split'": "exact fp32 masters held as the bf16 weight plus its low 16 bits: 2 bytes",
    "False / 'nearest'": "round to nearest (O3): updates below half an ulp are lost",
}
#: Values of ``optimizer_states``: how the optimizer's moments are stored.
OPTIMIZER_STATES = {
    "fp32": "the optimizer's own state (torch's: the dtype of what it steps)",
    "bf16": "bf16 moments, written with stochastic rounding (2 bytes per moment)",
    "8bit": "8-bit blockwise quartic-code moments (about 1.016 bytes per moment)",
    "8bit-bound": "as '8bit', each block's scale a bound known before the step (O4's): a "
    "compiled update in one pass, codes a little coarser",
}

#: The override names `initialize` accepts (Apex's, plus mixprec's `policy` and `num_losses`).
OVERRIDES = (
    "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
    "loss_scale", "min_loss_scale", "max_loss_scale", "cast_model_outputs", "num_losses",
    "policy", "fp8", "optimizer_states", "seed",
)  # fmt: skip
#: Online healing (`mixprec.heal`): a module that keeps overflowing moves to fp32 (O1).
OVERRIDES += ("heal",)


@dataclass(frozen=True)
class Option:
    """One resolved option: its value and why it has it."""

    name: str
    value: Any
    reason: str

    def __str__(self) -> str:
        value = dtype_name(self.value) if isinstance(self.value, torch.dtype) else self.value
        return f"{self.name:22s} = {value!s:10s} ({self.reason})"


@dataclass(frozen=True)
class AmpOptions:
    """An opt level resolved for a device and dtype, with overrides applied and explained."""

    level: OptLevel
    device_type: str
    dtype: torch.dtype
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool
    master_weights: bool
    loss_scale: str | float
    min_loss_scale: float | None
    max_loss_scale: float | None
    cast_model_outputs: torch.dtype | None
    num_losses: int
    policy: Policy
    options: tuple[Option, ...] = field(default=(), compare=False)
    fp8: Fp8Recipe | None = None
    device_reason: str = field(default="", compare=False)
    #: Online healing's settings (None: off): `mixprec.HealConfig`.
    heal: HealConfig | None = field(default=None, kw_only=True)
    #: Without fp32 masters, how updates reach low-precision weights: None (round to nearest,
    #: or fp32 masters when `master_weights`), 'stochastic' or 'kahan'.
    low_weights: str | None = None
    optimizer_states: str = "fp32"
    #: The seed of stochastic rounding (weights and bf16 states).
    seed: int = 0

    @property
    def low_memory(self) -> bool:
        """Whether the optimizer is replaced by a mixprec low-memory one (`mixprec.optim`)."""
        return self.low_weights is not None or self.optimizer_states != "fp32"

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether a dynamic loss scaler runs."""
        return self.loss_scale == "dynamic"

    @property
    def uses_scaler(self) -> bool:
        """Whether a loss scaler runs at all (dynamic, or a static scale other than 1)."""
        return self.dynamic_loss_scale or float(self.loss_scale) != 1.0

    def explained(self, name: str, reason: str) -> AmpOptions:
        """A copy whose option `name` gives `reason` (for a value a caller such as TrainStep
        chose on the user's behalf, so that printing it says why)."""
        opts = tuple(replace(o, reason=reason) if o.name == name else o for o in self.options)
        return replace(self, options=opts)

    def __str__(self) -> str:
        preset = PRESETS[self.level]
        why = f" ({self.device_reason})" if self.device_reason else ""
        lines = [preset.summary, "", preset.description, ""]
        if self.fp8 is not None:
            lines += [
                f"With FP8: the linear layers the policy's FP8 rules select run their three "
                f"matmuls on scaled FP8 operands (recipe {self.fp8.summary()}); every other op "
                f"as above. Scales live on the device and advance once per optimizer step "
                f"(not on a skipped one).",
                "",
            ]
        lines.append(f"Resolved for {self.device_type} / {dtype_name(self.dtype)}{why}:")
        lines += [f"  {opt}" for opt in self.options]
        return "\n".join(lines)


#: Apex's ceiling for the dynamic loss scale (its ``max_loss_scale`` default).
APEX_MAX_LOSS_SCALE = 2.0**24


def _dtype_named_by_model_type(value: Any) -> torch.dtype | None:
    """The 16-bit dtype `cast_model_type` names (torch.float16, 'bf16'), if it names one."""
    if value is None or isinstance(value, bool) or value == "low":
        return None
    try:
        parsed = parse_dtype(value)
    except (PolicyError, TypeError):
        return None  # _parse_model_type reports it
    return parsed if parsed in (torch.float16, torch.bfloat16) else None


def _parse_model_type(value: Any, low: torch.dtype) -> torch.dtype | None:
    if value is None or value is False:  # False: Apex's "leave the model's dtype alone"
        return None
    if value == "low":
        return low
    return parse_dtype(value)


def resolve(
    opt_level: str | OptLevel = "O1",
    *,
    device_type: str = "cuda",
    dtype: str | torch.dtype | None = None,
    **overrides: Any,
) -> AmpOptions:
    """Apply `overrides` to the preset `opt_level` for `device_type`/`dtype`, with reasons.

    Raises:
        PolicyError: an unknown level or override name, a bad value, or options that
            contradict each other (the message names both).
    """
    level = OptLevel.parse(opt_level)
    device_type = parse_device_type(device_type)
    overrides = _apex_values(overrides)
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:  # a TypeError too, as Python raises for Apex's unknown keyword arguments
        raise ArgumentTypeError(unknown_value("initialize option", unknown[0], OVERRIDES))
    preset = PRESETS[level]
    named = _dtype_named_by_model_type(overrides.get("cast_model_type")) if dtype is None else None
    choice = resolve_dtype(device_type, dtype if named is None else named)
    if named is not None:  # Apex code names the low dtype there (cast_model_type=torch.float16)
        choice = choice._replace(reason="named by cast_model_type")
    if dtype is None and overrides.get("master_weights", preset.master_weights) in (
        "stochastic",
        "split",
    ):
        # Stochastic rounding writes bf16 (the top half of fp32) weights: bf16 on every device.
        bf16 = resolve_dtype(device_type, "bf16")
        choice = bf16._replace(reason="the weights mode works on bf16 (the top half of fp32)")
    low = choice.dtype
    opts: list[Option] = []

    def pick(name: str, preset_value: Any, why: str) -> Any:
        if name in overrides:
            value = overrides[name]
            opts.append(Option(name, value, "set by the caller"))
            return value
        opts.append(Option(name, preset_value, why))
        return preset_value

    opts.append(Option("dtype", low, choice.reason))
    model_type = _parse_model_type(
        pick("cast_model_type", preset.cast_model_type,
             {"fp32": "the fp32 baseline", None: "weights stay fp32; autocast casts per op",
              "low": "weights in the low dtype"}[preset.cast_model_type]),
        low,
    )  # fmt: skip
    patch = bool(pick("patch_torch_functions", preset.patch_torch_functions,
                      "the forward runs under mixprec.autocast" if preset.patch_torch_functions
                      else "no per-op casting: the model's dtype decides"))  # fmt: skip
    keep_bn = pick("keep_batchnorm_fp32", preset.keep_batchnorm_fp32,
                   "normalization statistics need fp32's range and precision"
                   if preset.keep_batchnorm_fp32 else "no model cast, nothing to keep"
                   if preset.keep_batchnorm_fp32 is None else "pure low precision")  # fmt: skip
    master_value = pick("master_weights", preset.master_weights,
                        "updates smaller than the low dtype's resolution must accumulate in fp32"
                        if preset.master_weights is True else
                        "bf16 weights, stochastic rounding: small updates accumulate on average"
                        if preset.master_weights == "stochastic" else
                        "the optimizer's weights are already the model's")  # fmt: skip
    master, low_weights = _parse_master(master_value, low)
    states = pick(
        "optimizer_states",
        preset.optimizer_states,
        "the optimizer keeps its own state"
        if preset.optimizer_states == "fp32"
        else "8-bit blockwise states: 2 bytes per parameter for Adam's two moments",
    )
    if states not in OPTIMIZER_STATES:
        raise PolicyError(unknown_value("optimizer states mode", states, list(OPTIMIZER_STATES)))
    seed = (
        pick("seed", 0, "stochastic rounding's seed (bits from a counter hash)")
        if (low_weights == "stochastic" or states == "bf16")
        else overrides.get("seed", 0)
    )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ArgumentTypeError(f"seed={seed!r} must be an int.")
    default_scale: str | float = preset.loss_scale
    why_scale = "the preset"
    if level is OptLevel.O4 and low == torch.float16:
        default_scale = "dynamic"
        why_scale = ("fp16 gradients underflow below 6e-8 without scaling; the low-memory "
                     "optimizer unscales them in fp32 inside its update")  # fmt: skip
    elif level is OptLevel.O4:
        why_scale = "bf16 has fp32's exponent range: gradients do not underflow"
    elif preset.loss_scale == "dynamic" and low == torch.bfloat16:
        default_scale, why_scale = 1.0, "bf16 has fp32's exponent range: gradients do not underflow"
    elif preset.loss_scale == "dynamic":
        why_scale = "fp16 gradients underflow below 6e-8 without scaling"
    elif level is OptLevel.O0:
        why_scale = "fp32 gradients need no scaling"
    else:
        why_scale = "no master weights: the scaler cannot unscale low-precision gradients"
    loss_scale = pick("loss_scale", default_scale, why_scale)
    min_ls = pick("min_loss_scale", None, "no floor (a floor stops the scale collapsing)")
    max_ls = pick("max_loss_scale", APEX_MAX_LOSS_SCALE if loss_scale == "dynamic" else None,
                  "Apex's ceiling: a larger scale only risks more overflowing steps"
                  if loss_scale == "dynamic" else "a static scale does not grow")  # fmt: skip
    # Apex casts outputs where it casts the model (or where the caller asks); at O1, where it
    # patched torch instead, a loss called on the outputs ran in fp32 wherever it was called:
    # fp32 outputs give any loss computed outside the model's region the same.
    caller_type = overrides.get("cast_model_type", "low")
    uncast = preset.cast_model_type == "low" and caller_type in (None, False)
    outputs = pick("cast_model_outputs", None if uncast else preset.cast_model_outputs,
                   ("a loss computed outside the forward's autocast region runs in fp32"
                    if patch else "losses are computed in fp32 on the model's outputs")
                   if preset.cast_model_outputs and not uncast
                   else "outputs stay in the dtype the model computed them in")  # fmt: skip
    num_losses = pick("num_losses", 1, "one loss, one scale")
    policy = as_policy(pick("policy", Policy(), "torch.autocast's op lists"), "the policy override")
    fp8, policy = _resolve_fp8(level, overrides, policy, opts)
    heal, rows = heal_options(level.value, low, loss_scale, overrides.get("heal"), policy, patch)
    opts += [Option(*row) for row in rows]

    _check(level, low, model_type, patch, keep_bn, master, loss_scale, min_ls, max_ls,
           num_losses, policy, overrides, low_weights)  # fmt: skip
    return AmpOptions(
        level, device_type, low, model_type, patch, bool(keep_bn), master, loss_scale,
        min_ls, max_ls, _parse_model_type(outputs, low) if outputs else None, num_losses, policy,
        tuple(opts), fp8, heal=heal, low_weights=low_weights, optimizer_states=states, seed=seed,
    )  # fmt: skip


#: Options where None means "the level's default", as every option did in Apex ("any property
#: keyword argument that is not None is a manual override"). cast_model_type and
#: cast_model_outputs are not among them: there None means "leave the dtype alone" (O1's own
#: preset value; docs/migration.md lists the difference).
_NONE_IS_DEFAULT = frozenset({"master_weights", "keep_batchnorm_fp32", "loss_scale",
                              "patch_torch_functions"})  # fmt: skip
_BOOL_STRINGS = {"True": True, "False": False}


def _apex_values(overrides: dict[str, Any]) -> dict[str, Any]:
    """Option values as Apex read them: None for the default (`_NONE_IS_DEFAULT`), the strings
    argparse hands on ("True"/"False" for keep_batchnorm_fp32, "128.0" for loss_scale)."""
    out = {}
    for name, value in overrides.items():
        if value is None and name in _NONE_IS_DEFAULT:
            continue
        if name in ("keep_batchnorm_fp32", "patch_torch_functions") and isinstance(value, str):
            if value not in _BOOL_STRINGS:
                raise ArgumentTypeError(
                    f"{name}={value!r} is not a truth value: pass True or False (Apex's "
                    f"strings 'True' and 'False' are read as those)."
                )
            value = _BOOL_STRINGS[value]
        if name == "loss_scale" and isinstance(value, str) and value != "dynamic":
            with contextlib.suppress(ValueError):  # else _check names the valid values
                value = float(value)
        out[name] = value
    return out


def _parse_master(value: Any, low: torch.dtype) -> tuple[bool, str | None]:
    """``master_weights`` as (fp32 masters?, low-memory weights mode or None)."""
    if value is True or value == "fp32":
        return True, None
    if value is False or value is None or value == "nearest":
        return False, None
    if value in ("stochastic", "kahan", "split"):
        if value != "kahan" and low != torch.bfloat16:
            raise PolicyError(
                f"master_weights={value!r} works on bf16 (the top half of fp32), and this "
                f"run's low dtype is {dtype_name(low)}. Use dtype='bf16', or "
                f"master_weights='kahan' (a compensation buffer, any low dtype)."
            )
        return False, value
    meanings = "; ".join(f"{k}: {v}" for k, v in MASTER_WEIGHTS.items())
    raise PolicyError(
        f"unknown master_weights {value!r}. Valid: True or 'fp32', 'stochastic', 'kahan', "
        f"'split', False or 'nearest' ({meanings})."
    )


def _resolve_fp8(
    level: OptLevel, overrides: dict[str, Any], policy: Policy, opts: list[Option]
) -> tuple[Fp8Recipe | None, Policy]:
    """The FP8 recipe (None: off) and the policy with its FP8 module rules, with reasons.

    FP8 is on when ``fp8=`` names a recipe, or when the policy has FP8 module rules (then with
    the ``tensorwise`` recipe); ``fp8=False`` turns it off whatever the policy says.
    """
    value = overrides.get("fp8")
    rules = bool(policy.modules)
    if value is False or (value is None and not rules):
        why = "set by the caller" if value is False else "FP8 is opt-in (fp8='tensorwise', ...)"
        opts.append(Option("fp8", None, why))
        return None, policy
    if level is OptLevel.O0:
        raise PolicyError(
            "O0 is the fp32 baseline and cannot run FP8 layers. Use opt_level='O1' or 'O2' with "
            f"fp8={value if value is not None else 'tensorwise'!r} (bf16 elsewhere, fp32 masters "
            "in O2)."
        )
    if value is None or value is True:
        recipe = Fp8Recipe.named("tensorwise")
        why = ("the policy selects FP8 layers (" + str(policy).split("fp8=")[-1] + ")"
               if value is None else "fp8=True: the default recipe")  # fmt: skip
    else:
        recipe = Fp8Recipe.named(value)
        why = "set by the caller"
    opts.append(Option("fp8", recipe.summary(), why))
    if not rules:
        policy = policy.fp8("auto")
        opts.append(
            Option(
                "fp8 layers",
                "auto",
                "every linear layer with sizes multiple of 16 "
                "except the first and the last (policy.fp8(...) chooses others)",
            )
        )
    else:
        opts.append(Option("fp8 layers", "+".join(map(str, policy.modules)), "the policy's rules"))
    return recipe, policy


def _check(level, low, model_type, patch, keep_bn, master, loss_scale, min_ls, max_ls,
           num_losses, policy, overrides, low_weights=None) -> None:  # fmt: skip
    if not (
        loss_scale == "dynamic"
        or (
            isinstance(loss_scale, (int, float))
            and not isinstance(loss_scale, bool)
            and loss_scale > 0
        )
    ):
        typo = isinstance(loss_scale, str) and difflib.get_close_matches(loss_scale, ["dynamic"])
        raise PolicyError(
            f"loss_scale={loss_scale!r} is invalid: use 'dynamic' or a positive number "
            f"(1.0 turns loss scaling off)." + (" Did you mean 'dynamic'?" if typo else "")
        )  # fmt: skip
    for name, value in (("min_loss_scale", min_ls), ("max_loss_scale", max_ls)):
        if value is not None and not (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf
        ):  # fmt: skip
            raise PolicyError(f"{name}={value!r} is invalid: use None or a finite number > 0.")
    if min_ls is not None and max_ls is not None and min_ls > max_ls:
        raise UsageError(
            f"min_loss_scale={min_ls!r} is above max_loss_scale={max_ls!r}: the floor must not "
            f"exceed the ceiling."
        )
    if not (isinstance(num_losses, int) and not isinstance(num_losses, bool) and num_losses >= 1):
        raise PolicyError(f"num_losses={num_losses!r} is invalid: use an int >= 1.")
    if model_type not in (None, torch.float32, low):
        raise PolicyError(
            f"cast_model_type={dtype_name(model_type)!r} is neither fp32 nor this run's low "
            f"dtype {dtype_name(low)!r}. Valid: {format_options(['fp32', dtype_name(low)])} or "
            f"None; or run in {dtype_name(model_type)}: dtype={dtype_name(model_type)!r} (or no "
            f"dtype, which cast_model_type then names)."
        )
    low_model = model_type is not None and model_type != torch.float32
    scaled = loss_scale == "dynamic" or float(loss_scale) != 1.0
    # Low-memory weights come with mixprec's low-memory optimizers, which take the scale
    # themselves and divide the gradients by it in fp32 inside their update (torch's fused
    # contract), so fp16 gradients lose nothing to unscaling.
    if low_model and not master and scaled and not low_weights:
        raise UsageError(
            f"{level.value}: a {dtype_name(low)} model without master weights cannot use loss "
            f"scaling (loss_scale={loss_scale!r}): its gradients are {dtype_name(low)}, and a "
            f"scaler can only unscale fp32 gradients without losing their small values. Use "
            f"opt_level='O2' (master_weights=True), or loss_scale=1.0."
        )
    if low_weights and not low_model:
        raise UsageError(
            f"{level.value}: master_weights={low_weights!r} writes updates into low-precision "
            f"weights, and this model's weights stay fp32 (cast_model_type="
            f"{dtype_name(model_type) if model_type is not None else None!r}). Use "
            f"opt_level='O4' (or 'O3' with master_weights={low_weights!r})."
        )
    if master and not low_model and "cast_model_type" not in overrides:
        # With cast_model_type=False/None given, masters are kept for the parameters that are
        # low precision already (Apex's way for a model the caller cast); otherwise an fp32
        # model has nothing to be the master of.
        raise UsageError(
            f"{level.value}: master_weights=True needs a low-precision model to be the master "
            f"of (cast_model_type={dtype_name(low)!r}); with fp32 weights the master copies would "
            f"duplicate them for nothing. Use opt_level='O2', or drop master_weights (or pass "
            f"cast_model_type=False for a model whose weights you cast yourself)."
        )
    if level is OptLevel.O1 and "cast_model_type" in overrides and low_model:
        warnings.warn(
            "O1 casts around each op and expects fp32 weights; with cast_model_type="
            f"{dtype_name(low)!r} the weights are low precision too, which is O2/O3 territory. "
            "Consider opt_level='O2'.",
            UserWarning,
            stacklevel=4,
        )
    if low_model and "keep_batchnorm_fp32" in overrides and keep_bn is None:
        raise PolicyError("keep_batchnorm_fp32 must be True or False for a low-precision model.")
    if not low_model and overrides.get("keep_batchnorm_fp32"):
        warnings.warn(
            "keep_batchnorm_fp32=True has no effect: the model's weights are not cast.",
            UserWarning,
            stacklevel=4,
        )


def _this_machine() -> tuple[str, str]:
    """The device type a run here would use by default, and why."""
    if torch.cuda.is_available():
        return "cuda", "this machine's GPU; pass device_type='cpu' for the CPU's settings"
    return "cpu", ("no CUDA device on this machine; pass device_type='cuda' for a GPU's settings")


def describe(
    opt_level: str | OptLevel = "O1",
    *,
    device_type: str | None = None,
    dtype: str | torch.dtype | None = None,
    **overrides: Any,
) -> AmpOptions:
    """An opt level resolved with `overrides`; ``print()`` it for the summary, the paragraph and
    every option with the reason for its value.

    `device_type` defaults to this machine's: ``'cuda'`` where a GPU is visible, else ``'cpu'``
    (bf16, no loss scaling), and the printout says which and why; pass it to see another's.

    Examples:
        >>> print(mixprec.describe("O2", device_type="cpu"))   # doctest: +ELLIPSIS
        O2: low-precision model with fp32 normalization layers and fp32 master weights.
        ...
    """
    why = ""
    if device_type is None:
        device_type, why = _this_machine()
    options = resolve(opt_level, device_type=device_type, dtype=dtype, **overrides)
    return replace(options, device_reason=why) if why else options
