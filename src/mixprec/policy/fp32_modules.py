"""Modules kept in fp32: a policy's ``fp32_modules``, as data, and the pure function that finds
them in a model.

Op edits (``fp32=softmax``) act on an op wherever it runs. Some problems belong to a *place*
instead: the feed-forward output projection of a T5 block whose activations pass fp16's 65,504,
the attention of the one GPT layer whose logits do, a user's own layer that calls ``exp``. Moving
the op everywhere costs every layer its low-precision speed; moving the module costs only that
module. Transformers keeps such lists by hand (``_keep_in_fp32_modules = ["wo"]``); in mixprec
the policy carries them, ``mixprec.tune_policy`` finds them on a few batches and healing
(``initialize(..., heal=True)``) adds them during a run.

A selector is a module's qualified name (``encoder.block.3.layer.1.DenseReluDense.wo``) or a
glob over qualified names as ``fnmatch`` reads it (``blocks.*.ff.wo``). A kept module runs its
whole forward with autocast off and its floating inputs cast to fp32, so every op inside it
(and its backward) computes in fp32; its outputs stay fp32, which is the point when the values
themselves exceed the low dtype's range. Where mixprec knows the model (``initialize``,
``TrainStep``, the integrations, ``explain``) the selectors are applied with forward hooks
(`mixprec.levels.keep_fp32`); a plain ``mixprec.autocast`` region does not know the model and
leaves them alone, as it leaves the FP8 module rules.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable

from torch import nn

from mixprec.errors import PolicyError

__all__ = ["check_selector", "escalate", "missing_selectors", "select_fp32"]

_FORBIDDEN = set(",+=@ \t\n")


def check_selector(text: object) -> str:
    """`text` as a valid module selector (stripped), or a PolicyError saying what one is."""
    if not isinstance(text, str):
        raise PolicyError(
            f"a module kept in fp32 is named by a string (a qualified module name such as "
            f"'blocks.3.ff.wo', or a glob such as 'blocks.*.ff.wo'), got "
            f"{type(text).__name__} {text!r}."
        )
    name = text.strip()
    if not name or _FORBIDDEN & set(name):
        raise PolicyError(
            f"module selector {text!r} is not valid: use a qualified module name as "
            f"model.named_modules() lists it ('blocks.3.ff.wo') or a glob over such names "
            f"('blocks.*.ff.wo'); no spaces, ',', '+', '=' or '@'. Join several with '+' in the "
            f"string form: 'fp32_modules=blocks.0.ff.wo+head'."
        )
    return name


def select_fp32(model: nn.Module, selectors: Iterable[str], *, strict: bool = True) -> list[str]:
    """The qualified names of `model`'s modules that `selectors` keep in fp32, in model order.

    A module inside another selected module is left out (its parent's fp32 region covers it).
    Pure: reads the model's module names, changes nothing. With ``strict=False`` a selector
    that names no module is skipped (``initialize`` with several models checks that each
    selector names a module in one of them: `missing_selectors`).

    Raises:
        PolicyError: a selector that names no module of `model` (the message lists the closest
            names). The model itself is never selected (O0 is the fp32 model).
    """
    names = [n for n, _ in model.named_modules() if n]
    chosen: set[str] = set()
    for selector in selectors:
        hits = [n for n in names if fnmatch.fnmatchcase(n, selector)]
        if not hits and strict:
            close = difflib.get_close_matches(selector, names, n=3, cutoff=0.5)
            shown = ", ".join(repr(n) for n in (close or names[:4]))
            hint = f" Closest names: {shown}." if close else f" Its modules include {shown}."

            raise PolicyError(
                f"the policy keeps {selector!r} in fp32, but {type(model).__name__} has no "
                f"module of that name.{hint} Selectors are qualified names from "
                f"model.named_modules() or globs over them ('blocks.*.ff.wo')."
            )
        chosen.update(hits)
    ordered = [n for n in names if n in chosen]
    return [n for n in ordered if not any(n.startswith(p + ".") for p in ordered if p != n)]


def missing_selectors(models: Iterable[nn.Module], selectors: Iterable[str]) -> None:
    """Raise for the first selector that names a module in none of `models` (one model:
    `select_fp32`'s error, with the closest names)."""
    models = list(models)
    for selector in selectors:
        if any(select_fp32(m, [selector], strict=False) for m in models):
            continue
        select_fp32(models[0], [selector])  # raises, naming the closest modules


def escalate(model: nn.Module, name: str, kept: Iterable[str]) -> tuple[str, bool]:
    """The module to keep in fp32 for an overflow first seen in `name`: `name` itself, or, when
    it runs in fp32 already (it or an ancestor is in `kept`), the nearest ancestor outside
    `kept` whose forward runs (a ``ModuleList`` is never called: hooks on it never fire). The
    flag says whether it moved up; ``''`` means only the model itself is left."""
    modules = dict(model.named_modules())
    kept = list(kept)
    target, moved = name, False

    def inside(n: str) -> bool:
        return any(n == k or n.startswith(k + ".") for k in kept)

    def runs(n: str) -> bool:
        return type(modules[n]).forward is not nn.Module.forward

    while target and (inside(target) or not runs(target)):
        target, moved = target.rpartition(".")[0], True
    return target, moved
