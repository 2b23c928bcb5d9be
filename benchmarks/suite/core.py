"""The machinery of ``gpu_suite.py`` and ``cpu_goals.py``: parts, goals, one process per
part, records, merging.

Nothing here knows about mixprec: a `Part` is a command line plus a function that turns what
the command wrote into `Figures`, and a list of `Goal`s judged on those figures. `run_parts`
runs parts in priority order, each in its own process group with its own timeout, and hands
every finished record to a callback at once (the suite rewrites its output files there, so a
call killed at its time limit still leaves every finished part behind).

Statuses: ``ok``; ``failed`` (an exit status outside the part's ``ok_returncodes``, an output
that cannot be read, or problems the extractor reported, such as failing tests, in which case
the figures are kept); ``timeout``;
``skipped`` (a missing Python module, or not enough budget left; the reason says which and
what to do).
"""

from __future__ import annotations

import datetime as _dt
import json
import operator
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMAT = "mixprec-gpu-suite/1"

# How to bring a module the device lacks (its image has no package index): the device README's
# recipe. {dist} is the distribution to download.
CARRY_RECIPE = (
    "here, in the repository root: `echo /.whl/ >> .git/info/exclude; python3 -m pip download "
    "--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform "
    "manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl {dist}`, then name `.whl` "
    "in the run's carry list: the suite installs every wheel it finds in .whl (--wheels)"
)
# Import names whose distribution is named differently.
DISTRIBUTIONS = {"yaml": "PyYAML", "sklearn": "scikit-learn", "PIL": "pillow", "cv2":
                 "opencv-python-headless"}  # fmt: skip

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq,
}  # fmt: skip


def now() -> str:
    """Local time, ISO 8601 to the second, with its UTC offset."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


@dataclass(frozen=True)
class Goal:
    """A promise, judged on one figure: ``figures[figure] <op> target``.

    `cuda_only` goals are claims about a GPU: on a CPU run the figure is shown, not judged.
    A goal that `needs` a capability (``"fast-bf16"``: 16-bit matmuls at least as fast as
    fp32's) is shown, not judged, on a machine that lacks it.
    """

    figure: str
    op: str
    target: float
    text: str
    cuda_only: bool = True
    needs: str = ""

    def judge(self, figures: Figures | None, device: str, why_absent: str = "",
              lacks: dict[str, str] | None = None) -> dict:  # fmt: skip
        """{'goal', 'figure', 'op', 'target', 'value', 'verdict', 'detail'}.

        `lacks`: the capabilities this machine lacks, each with the reason (how it was found).
        """
        out = {"goal": self.text, "figure": self.figure, "op": self.op, "target": self.target,
               "value": None, "verdict": "NOT MEASURED", "detail": why_absent}  # fmt: skip
        if figures is None:
            return out
        value = figures.values.get(self.figure)
        out["value"] = value
        if value is None:
            out["detail"] = figures.unmeasured.get(self.figure, why_absent or "no figure")
            return out
        if self.cuda_only and device != "cuda":
            out.update(verdict="NOT JUDGED", detail="a CPU run: the goal is a claim about a GPU")
            return out
        if self.needs and self.needs in (lacks or {}):
            out.update(verdict="NOT JUDGED", detail=(lacks or {})[self.needs])
            return out
        out["verdict"] = "MET" if _OPS[self.op](value, self.target) else "MISSED"
        return out


@dataclass
class Figures:
    """What a part measured: named values, why some are absent, problems, a table for people."""

    values: dict[str, Any] = field(default_factory=dict)
    unmeasured: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    table: list[dict[str, Any]] = field(default_factory=list)
    raw: Any = None

    def put(self, key: str, value: Any, why: str = "") -> None:
        """Record a figure; a None value needs the reason it could not be measured."""
        self.values[key] = value
        if value is None:
            self.unmeasured[key] = why or "not measured"


@dataclass(frozen=True)
class Context:
    """What a part's command and extractor may use."""

    smoke: bool
    device: str  # "cuda" or "cpu", as the probe found it in the parts' environment
    work: str  # this part's scratch folder (packed into logs.tar.gz)
    root: str  # the repository root (the working directory of every part)
    python: str = sys.executable

    def path(self, name: str) -> str:
        return os.path.join(self.work, name)


@dataclass(frozen=True)
class Part:
    """One step of the suite: a command in its own process, its figures and its goals.

    Args:
        name: short, unique, in letters, digits and '-' (``d-gpt2``); ``--only`` matches it or
            the piece before its first '-'.
        title: one line for the summary and ``--help``.
        priority: parts run in increasing priority.
        estimate_s: expected seconds on the GPU: a part starts only if this fits the budget left.
        timeout_s: its process is killed after this (smoke runs use `smoke_timeout_s`).
        command: argv, given the `Context` (``ctx.smoke`` for toy sizes, ``ctx.path()`` for
            output files).
        extract: reads what the command wrote (and its log text) into `Figures`.
        goals: judged on the figures.
        requires: modules the command imports that the device might lack (probed first).
        ok_returncodes: exit statuses that still mean "it ran" (the extractor judges the rest).
        artefacts: (file in the work folder, name in --out) copied to --out when present.
    """

    name: str
    title: str
    priority: int
    estimate_s: float
    timeout_s: float
    command: Callable[[Context], list[str]]
    extract: Callable[[Context, str], Figures]
    goals: tuple[Goal, ...] = ()
    requires: tuple[str, ...] = ()
    ok_returncodes: tuple[int, ...] = (0,)
    artefacts: tuple[tuple[str, str], ...] = ()
    smoke_timeout_s: float = 120.0


class Stopped(Exception):
    """The suite received SIGTERM or SIGINT: stop the part in flight, write what is done.

    `record` is the in-flight part's record (status ``timeout``) once `run_part` has made it.
    """

    record: dict[str, Any] | None = None


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGINT into `Stopped`, so outputs are written before the suite exits."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stopped)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a part and everything it started (its own process group, not a new session:
    the device ends a command's processes when the command returns, except new sessions)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


# Its own process group, so that a timeout ends the part's children too (pytest's, compile
# workers). `process_group` is Python 3.11+; `preexec_fn` does the same on 3.10.
_NEW_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


def tail(text: str, lines: int = 40, chars: int = 4000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def run_command(argv: Sequence[str], *, cwd: str, env: dict[str, str], log_path: str,
                timeout: float, launcher: Any = None) -> tuple[int | None, bool, str]:  # fmt: skip
    """Run `argv` in its own process group, output to `log_path`: (exit status, timed out, log).

    `launcher` (a `suite.launch.Preloaded`, whose environment is `env`) forks the command from
    a server that imported torch once, where it can; otherwise it starts fresh.
    """
    timed_out = False
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        if launcher is not None and launcher.handles(argv):
            rc, timed_out = launcher.run(argv, cwd=cwd, log_path=log_path, timeout=timeout)
            with open(log_path, errors="replace") as done:
                return rc, timed_out, done.read()
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, **_NEW_GROUP)  # fmt: skip
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = None, True
        except Stopped:
            _kill_group(proc)
            raise
    with open(log_path, errors="replace") as log:
        return rc, timed_out, log.read()


def run_part(part: Part, ctx: Context, *, env: dict[str, str], timeout: float,
             meta: dict[str, Any], launcher: Any = None,
             lacks: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run one part; its record (status, figures, judged goals, the command and `meta`)."""
    os.makedirs(ctx.work, exist_ok=True)
    argv = part.command(ctx)
    record = new_record(part, meta, status="failed")
    record.update(command=shlex.join(argv), started=now(), timeout_s=round(timeout))
    t0 = time.monotonic()
    log_path = ctx.path(f"{part.name}.log")
    try:
        rc, timed_out, output = run_command(argv, cwd=ctx.root, env=env, log_path=log_path,
                                            timeout=timeout, launcher=launcher)  # fmt: skip
    except Stopped as why:
        record.update(status="timeout", ended=now(), duration_s=round(time.monotonic() - t0, 1),
                      reason=f"the suite was stopped ({why}) while this part ran")  # fmt: skip
        with open(log_path, errors="replace") as log:
            record["error_tail"] = tail(log.read())
        finalize(part, record, None, ctx.device, lacks)
        why.record = record
        raise
    record.update(ended=now(), duration_s=round(time.monotonic() - t0, 1), returncode=rc)
    reasons: list[str] = []
    figures: Figures | None = None
    if timed_out:
        reasons.append(f"killed after its timeout of {timeout:.0f} s")
        try:  # what it wrote before (benchmarks that write as they go keep finished rows)
            figures = part.extract(ctx, output)
        except Exception:  # nothing readable yet: the timeout is the whole story
            figures = None
        else:
            reasons.append("figures are from the output it wrote before")
    elif rc not in part.ok_returncodes:
        reasons.append(f"exit status {rc}")
    else:
        try:
            figures = part.extract(ctx, output)
        except Exception as err:  # a part whose output cannot be read is a failed part
            reasons.append(f"its output could not be read: {type(err).__name__}: {err}")
    if figures is not None:
        reasons += figures.problems
    record["status"] = "timeout" if timed_out else ("failed" if reasons else "ok")
    record["reason"] = "; ".join(reasons)[:2000]
    if record["status"] != "ok":
        record["error_tail"] = tail(output)
    finalize(part, record, figures, ctx.device, lacks)
    return record


def new_record(part: Part, meta: dict[str, Any], *, status: str, reason: str = "") -> dict:
    return {"part": part.name, "title": part.title, "priority": part.priority, **meta,
            "status": status, "reason": reason, "command": None, "started": None,
            "ended": None, "duration_s": None, "returncode": None, "figures": {},
            "unmeasured": {}, "table": [], "goals": [], "error_tail": "", "raw": None}  # fmt: skip


def finalize(part: Part, record: dict, figures: Figures | None, device: str,
             lacks: dict[str, str] | None = None) -> dict:  # fmt: skip
    """Store the figures and judge the part's goals into `record` (`lacks`: `Goal.judge`)."""
    if figures is not None:
        record.update(figures=figures.values, unmeasured=figures.unmeasured,
                      table=figures.table, raw=figures.raw)  # fmt: skip
    why = f"part {record['status']}" + (f": {record['reason']}" if record["reason"] else "")
    record["goals"] = [g.judge(figures, device, why, lacks) for g in part.goals]
    return record


def missing_module_reason(module: str, info: dict[str, Any]) -> str:
    """The skip reason for a part whose `module` does not import, with the carry recipe."""
    missing = info.get("missing")
    if missing:
        dist = DISTRIBUTIONS.get(missing.split(".")[0], missing.split(".")[0])
        return (f"missing Python module {missing!r} (imported by {module}); carry it as a "
                f"wheel: {CARRY_RECIPE.format(dist=dist)}")  # fmt: skip
    return f"{module} does not import: {info.get('error', '?')}"


def run_parts(parts: Sequence[Part], *, make_ctx: Callable[[Part], Context],
              env: dict[str, str], budget_s: float, started: float, meta: dict[str, Any],
              modules: dict[str, dict[str, Any]],
              on_record: Callable[[dict[str, Any]], None], launcher: Any = None,
              lacks: dict[str, str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Run `parts` in priority order within `budget_s` (counted from `started`, monotonic).

    A part is skipped when a module it requires is missing (`modules`: the probe's answers)
    or when its estimate does not fit the budget left; otherwise it runs with its timeout cut
    to what is left (forked by `launcher` where it can: `run_command`). `on_record` sees each
    record as soon as it exists. `lacks`: the capabilities the machine lacks (`Goal.judge`).
    """
    records = []
    for part in sorted(parts, key=lambda p: p.priority):
        ctx = make_ctx(part)
        left = budget_s - (time.monotonic() - started)
        absent = [m for m in part.requires if modules.get(m, {}).get("ok") is False]
        estimate = 0.0 if ctx.smoke else part.estimate_s
        if absent:
            record = new_record(
                part,
                meta,
                status="skipped",
                reason=missing_module_reason(absent[0], modules[absent[0]]),
            )
            record["figures"] = {"missing_module": modules[absent[0]].get("missing")}
            finalize(part, record, None, ctx.device, lacks)
        elif left < max(estimate, 5.0):
            record = new_record(
                part,
                meta,
                status="skipped",
                reason=f"budget: {left:.0f} s left, this part needs about "
                f"{estimate:.0f} s; run it in another call (--only {part.name})",
            )
            finalize(part, record, None, ctx.device, lacks)
        else:
            limit = min(part.smoke_timeout_s if ctx.smoke else part.timeout_s, left)
            try:
                record = run_part(part, ctx, env=env, timeout=limit, meta=meta,
                                  launcher=launcher, lacks=lacks)  # fmt: skip
            except Stopped as stop:
                if stop.record is not None:
                    records.append(stop.record)
                    on_record(stop.record)
                raise
        records.append(record)
        on_record(record)
    return records


def write_json(path: str, data: Any) -> None:
    """Write atomically (a reader, or a kill, never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One results document from several calls' ``results.json``.

    Calls are kept in order; for a part run in several calls the latest ``ok`` record wins,
    else the latest one (a re-run after a fix replaces the failure).
    """
    calls: list[dict] = []
    parts: dict[str, dict] = {}
    for doc in results:
        if doc.get("format") != FORMAT:
            raise ValueError(f"not a gpu_suite results file (format {doc.get('format')!r}, "
                             f"expected {FORMAT!r})")  # fmt: skip
        calls += doc["calls"]
        for name, rec in doc["parts"].items():
            old = parts.get(name)
            if old is None or rec["status"] == "ok" or old["status"] != "ok":
                parts[name] = rec
    return {"format": FORMAT, "calls": calls, "parts": parts}
