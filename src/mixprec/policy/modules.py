"""Module rules: which ``nn.Linear`` layers run in FP8. Pure data plus one pure function, `plan`.

FP8 is decided per *layer*, not per op: a layer's scales and amax histories belong to that layer,
and the FP8 matmul replaces the whole linear (forward and both backward products). So the
policy carries, next to its op edits, an ordered tuple of module rules, each a selector and a
verdict; the last rule that selects a layer decides, like the op edits. Selectors:

- ``auto``: every ``nn.Linear`` whose ``in_features`` and ``out_features`` are multiples of 16
  (what the FP8 tensor-core GEMM requires), except the first and the last linear layer of the
  model in registration order: the first sees the raw input and the last produces the logits,
  where FP8's 3 mantissa bits cost the most accuracy (Transformer Engine and torchao users keep
  them in bf16 for the same reason);
- ``all``: every ``nn.Linear`` whose dimensions are multiples of 16;
- a glob over qualified module names (``blocks.*.mlp.*``, ``head``), as ``fnmatch`` reads it.

A rule either puts the layers it selects in FP8 (``fp8=...`` in the string form) or keeps them
out (``fp8=!head``): such a layer follows the op policy like any other (its ``linear`` call runs
in the low dtype). A selected layer whose dimensions are not multiples of 16 stays out, and its
decision says why. So does a linear layer whose forward its parent never calls: the output
projection of ``nn.MultiheadAttention`` (``out_proj``), whose weight MHA passes straight to
``F.multi_head_attention_forward``; swapped for an FP8 layer it would never run in FP8, so no
rule selects it (a plan lists only layers that will run in FP8).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from mixprec.errors import PolicyError
from mixprec.policy.categories import OpCategory

__all__ = ["DEFAULT_FP8_RULES", "ModuleDecision", "ModuleRule", "plan"]

#: The granularity FP8 GEMMs need in both feature dimensions.
ALIGN = 16
_KEYWORDS = ("auto", "all")
_FORBIDDEN = set(",+=@ \t\n")


@dataclass(frozen=True)
class ModuleRule:
    """Put the linear layers `pattern` selects in FP8 (`fp8` True) or keep them out (False)."""

    pattern: str
    fp8: bool = True

    @classmethod
    def parse(cls, text: str) -> ModuleRule:
        """``'auto'``, ``'all'``, a glob, or any of these after ``!`` (keep out of FP8)."""
        if not isinstance(text, str):
            raise PolicyError(
                f"an FP8 module selector must be a string ('auto', 'all', a glob over module "
                f"names such as 'blocks.*.mlp.*', or '!name' to keep a layer out), got "
                f"{type(text).__name__} {text!r}."
            )
        raw = text.strip()
        fp8 = not raw.startswith("!")
        pattern = raw.lstrip("!").strip()
        if not pattern or _FORBIDDEN & set(pattern):
            raise PolicyError(
                f"FP8 module selector {text!r} is not valid: use 'auto', 'all', a glob over "
                f"qualified module names ('blocks.*.mlp.fc', 'head') or '!<selector>' to keep "
                f"layers out of FP8; no spaces, ',', '+', '=' or '@'. Join several with '+' in "
                f"the string form: 'fp8=auto+!head'."
            )
        return cls(pattern, fp8)

    def __str__(self) -> str:
        return self.pattern if self.fp8 else "!" + self.pattern


@dataclass(frozen=True)
class ModuleDecision:
    """Whether one linear layer runs in FP8, and why.

    Attributes:
        module: its qualified name in the model (``''`` for the model itself).
        category: ``OpCategory.FP8`` or ``OpCategory.LOWER`` (follows the op policy).
        reason: a sentence naming the rule that decided.
        in_features, out_features: the layer's sizes.
    """

    module: str
    category: OpCategory
    reason: str
    in_features: int
    out_features: int

    @property
    def fp8(self) -> bool:
        """Whether the layer runs in FP8."""
        return self.category is OpCategory.FP8

    def __str__(self) -> str:
        where = "fp8" if self.fp8 else "not fp8 (op policy)"
        shape = f"{self.in_features}->{self.out_features}"
        return f"{self.module or '<model>'} [{shape}]: {where} ({self.reason})"


#: What ``fp8=...`` means when a policy names no module rule: ``auto``.
DEFAULT_FP8_RULES: tuple[ModuleRule, ...] = (ModuleRule("auto"),)


def _misaligned(layer: nn.Linear) -> str | None:
    bad = [f"{name}={getattr(layer, name)}" for name in ("in_features", "out_features")
           if getattr(layer, name) % ALIGN]  # fmt: skip
    if not bad:
        return None
    return (f"{' and '.join(bad)} not a multiple of {ALIGN}, which FP8 GEMMs need (pad the "
            f"layer, or leave it in the low dtype)")  # fmt: skip


#: Modules that use a child linear layer's weight without calling the layer (its forward never
#: runs), with the reason an FP8 plan gives.
BYPASSING = {
    nn.MultiheadAttention: "nn.MultiheadAttention passes this projection's weight straight to "
    "F.multi_head_attention_forward and never calls the layer, so an FP8 layer here would not "
    "run in FP8; it follows the op policy",
}


def _bypassed(model: nn.Module) -> dict[str, str]:
    """Qualified names of the linear layers a parent bypasses, and why."""
    out = {}
    for name, parent in model.named_modules():
        why = next((w for cls, w in BYPASSING.items() if isinstance(parent, cls)), None)
        if why is None:
            continue
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                out[f"{name}.{child_name}" if name else child_name] = why
    return out


def plan(model: nn.Module, rules: Iterable[ModuleRule]) -> tuple[ModuleDecision, ...]:
    """The FP8 decision for every ``nn.Linear`` in `model`, in registration order.

    Pure: reads the model's structure (names, types, sizes), changes nothing.
    """
    rules = tuple(rules)
    bypassed = _bypassed(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    first = linears[0][0] if linears else None
    last = linears[-1][0] if linears else None
    out = []
    for name, layer in linears:
        fp8, why, by = False, "no FP8 rule selects it: it follows the op policy", None
        for rule in rules:
            hit = _selects(rule, name, layer, first, last)
            if hit is True:
                fp8, by = rule.fp8, rule
                why = (f"selected by fp8={rule}" if rule.fp8
                       else f"kept out of FP8 by fp8={rule}: it follows the op policy")  # fmt: skip
            elif isinstance(hit, str) and not fp8:  # 'auto' declines it, and says why
                why = f"fp8={rule} leaves it out: {hit}"
        misaligned = _misaligned(layer)
        if fp8 and name in bypassed:
            fp8, why = False, f"{why}, but {bypassed[name]}"
        elif fp8 and misaligned:
            fp8, why = False, f"{why}, but {misaligned}"
        elif fp8 and by is not None and by.pattern == "auto":
            why += f": a linear layer with sizes multiple of {ALIGN}, neither first nor last"
        category = OpCategory.FP8 if fp8 else OpCategory.LOWER
        out.append(ModuleDecision(name, category, why, layer.in_features, layer.out_features))
    return tuple(out)


def _selects(rule: ModuleRule, name: str, layer: nn.Linear, first: str | None,
             last: str | None) -> bool | str | None:  # fmt: skip
    """True: selected; None: not selected; a string: 'auto' declines, and why."""
    if rule.pattern == "all":
        return True
    if rule.pattern == "auto":
        misaligned = _misaligned(layer)
        if misaligned:
            return misaligned
        if name == first:
            return ("the first linear layer (it sees the raw input; FP8's 3 mantissa bits "
                    "cost the most there)")  # fmt: skip
        if name == last:
            return ("the last linear layer (it produces the output; FP8's 3 mantissa bits "
                    "cost the most there)")  # fmt: skip
        return True
    return True if fnmatch.fnmatchcase(name, rule.pattern) else None
