"""Exception types raised by mixprec, and the helper that lists valid options in messages.

Every error a user can cause names the bad value, lists what would have been accepted, and says
how to fix it. Lists of valid names are generated from the tables they come from, never typed by
hand, so a message cannot advertise an option that does not exist.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "AutocastError",
    "BannedOpError",
    "DeviceTypeError",
    "MixprecError",
    "PolicyError",
    "UsageError",
    "format_options",
    "unknown_value",
]


class MixprecError(Exception):
    """Base class of every error mixprec raises on purpose."""


class PolicyError(MixprecError, ValueError):
    """A policy, an op name, a category, a dtype or a device type is not valid."""


class ArgumentValueError(MixprecError, ValueError):
    """An argument of the right type with a value that is not accepted (a count below 1, a
    number out of range, an unknown option of a diagnostic or tuning call).

    A ValueError, what Python raises for these, so ``except ValueError`` keeps working.
    """


class ArgumentTypeError(PolicyError, TypeError):
    """An argument of the wrong type, or an unknown keyword argument.

    Also a TypeError: what Python raises for an unknown keyword, and what Apex's ``initialize``
    raised for models or optimizers of the wrong type, so ``except TypeError`` keeps working.
    """


class UsageError(PolicyError, RuntimeError):
    """A call or a combination of options that cannot work (an unknown opt level, options that
    contradict each other, an optimizer initialized twice or never).

    Also a RuntimeError: what Apex raised for these, so ``except RuntimeError`` keeps working.
    """


class AutocastError(MixprecError, RuntimeError):
    """An autocast region was used in a way that cannot work (device or dtype unsupported)."""


class DeviceTypeError(PolicyError, RuntimeError):
    """An unknown device type (``'tpu'``, ``'gpu'``...).

    A PolicyError (a ValueError), like every bad name mixprec is given, and also a RuntimeError,
    which ``torch.autocast`` raises for one: ``except RuntimeError`` written for torch keeps
    working.
    """


class BannedOpError(MixprecError, NotImplementedError):
    """An op the policy marks as unsafe to autocast was called inside an autocast region.

    A NotImplementedError, as Apex raised for these ops, and so a RuntimeError, as torch raises.
    """


def format_options(options: Iterable[object]) -> str:
    """Render valid options as ``'a', 'b' or 'c'`` (sorted, quoted)."""
    items = sorted({str(o) for o in options})
    quoted = [repr(o) for o in items]
    if not quoted:
        return "(none)"
    if len(quoted) == 1:
        return quoted[0]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def unknown_value(
    kind: str,
    value: object,
    options: Iterable[object],
    hint: str = "",
    aliases: Mapping[str, str] | None = None,
) -> str:
    """Build the message for an unknown name: what was given, close matches, the valid options.

    `aliases` maps names people use for an option (``'gpu'``) to the option itself (``'cuda'``):
    such a name is answered with its option rather than with spelling neighbours.
    """
    opts = sorted({str(o) for o in options})
    consonant_y = kind.endswith("y") and kind[-2:-1] not in ("a", "e", "i", "o", "u")
    plural = kind[:-1] + "ies" if consonant_y else kind + "s"
    msg = f"unknown {kind} {value!r}."
    alias = (aliases or {}).get(str(value).strip().lower())
    close = [alias] if alias else difflib.get_close_matches(str(value), opts, n=3, cutoff=0.6)
    if close:
        msg += f" Did you mean {format_options(close)}?"
    if len(opts) <= 40:
        msg += f" Valid {plural}: {format_options(opts)}."
    else:
        msg += f" There are {len(opts)} valid {plural}."
    if hint:
        msg += " " + hint
    return msg
