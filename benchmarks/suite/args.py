"""The comma-separated list options of the benchmark scripts (``--variants O1,O2``), checked.

An empty item (``O1,,O2``, a trailing comma), an empty list or a name given twice is refused
rather than dropped or run twice, as `mixprec bench --variants` does (``mixprec.cli``): it is
most often a name left out by mistake, and a run that quietly measures fewer (or repeated) rows
than were asked for reads as an answer to the question asked. An unknown name is refused with
the valid ones instead of a KeyError's traceback or a run that skips it.

The wording follows ``mixprec.cli._choices``; it is not imported from there because
gpu_suite.py and cpu_goals.py import no mixprec (the suite installs and probes it in the parts'
own processes), and a script's unknown-name message keeps its ``unknown X; valid: ...`` form.
Scripts put ``benchmarks/`` on ``sys.path`` and import it as ``suite.args``. Beside the lists:
``--start-method``, how the scripts that start CPU ranks themselves start them.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = [
    "UsageError", "check_start_method", "comma_list", "list_error", "start_method_option",
    "usage_error",
]  # fmt: skip


def list_error(value: str, valid: Sequence[str], flag: str, *, none: str | None = None,
               shown: Sequence[str] | None = None,
               also: str = "") -> tuple[list[str], str | None]:  # fmt: skip
    """The names of `value` (stripped, in order) and what is wrong with them, or None.

    `none` is what an empty `value` means where one is accepted on purpose (``"--speed
    only"``): then ``''`` gives no names and no error. The messages list `shown` (default:
    `valid`), then `also` (other accepted spellings, e.g. ``" (or a letter: a, b)"``).
    """
    shown = valid if shown is None else shown
    if none is not None and not value.strip():
        return [], None
    names = [v.strip() for v in value.split(",")]
    valid_text = f"{', '.join(shown)}{also}"
    bad = list(dict.fromkeys(n for n in names if n and n not in valid))
    # The fix, spelt with the user's own names where there are some (O1,,O2 -> O1,O2).
    given = ",".join(dict.fromkeys(n for n in names if n)) or ",".join(shown[:2])
    example = f"{flag} {shlex.quote(given)}"  # quoted where a name has a space
    if bad:
        close = difflib.get_close_matches(bad[0], valid, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return names, f"{flag} {value!r}: unknown {', '.join(bad)}{hint}; valid: {valid_text}."
    if not any(names):
        empty = f", or {flag} '' ({none})" if none is not None else ""
        return names, (f"{flag} {value!r} names nothing. Name at least one, comma-separated "
                       f"(e.g. {example}){empty}. Valid: {valid_text}.")  # fmt: skip
    if "" in names:
        return names, (f"{flag} {value!r} has an empty item (two commas in a row, or a comma "
                       f"at an end). Drop the extra comma ({example}) or name the one left "
                       f"out. Valid: {valid_text}.")  # fmt: skip
    twice = sorted({n for n in names if names.count(n) > 1}, key=names.index)
    if twice:
        return names, (f"{flag} {value!r} names {', '.join(map(repr, twice))} more than once; "
                       f"give each name once: {example}. Valid: {valid_text}.")  # fmt: skip
    return names, None


def comma_list(parser: argparse.ArgumentParser, flag: str, value: str, valid: Sequence[str],
               *, none: str | None = None) -> list[str]:  # fmt: skip
    """The names of the list option `flag` given as `value`, each one of `valid` and given once;
    else `parser.error` (the usage and the message on stderr, exit status 2).

    `none`: what ``flag ''`` means, where an empty list is accepted on purpose (see
    `list_error`); without it ``''`` is refused.
    """
    names, error = list_error(value, valid, flag, none=none)
    if error:
        parser.error(error)
    return names


class UsageError(SystemExit):
    """A command-line error raised outside argparse: exit status 2, as `parser.error`'s, with
    the message (already written to stderr) as its text, for a caller or a test to read."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def usage_error(prog: str, message: str) -> NoReturn:
    """``prog: error: message`` on stderr, then exit status 2 (`UsageError`)."""
    text = f"{prog}: error: {message}"
    print(text, file=sys.stderr)
    raise UsageError(text)


def start_method_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--start-method forkserver|fork`` to a script that starts its ranks itself."""
    parser.add_argument("--start-method", choices=("forkserver", "fork"), default="forkserver",
                        help="how the ranks start: forked from a server that imports this "
                        "script (the default); or fork, straight from this process, which has "
                        "torch and mixprec imported already: CPU only (a CUDA context does "
                        "not survive a fork), saves the server's imports (the GPU suite's "
                        "smoke run)")  # fmt: skip


def check_start_method(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``--start-method fork`` with ``--device cuda`` (status 2, with the fix)."""
    if args.start_method == "fork" and args.device == "cuda":
        parser.error("--start-method fork is for --device cpu (CUDA does not survive a fork); "
                     "drop it, or use --start-method forkserver")  # fmt: skip
