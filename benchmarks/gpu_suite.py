"""Every GPU promise of mixprec, measured by one command that survives partial failure.

    python benchmarks/gpu_suite.py --out DIR [--budget-min 25] [--only a,b,c] [--wheels .whl]
    python benchmarks/gpu_suite.py --smoke --out /tmp/smoke          # toy sizes on the CPU
    python benchmarks/gpu_suite.py --summarize CALL1 CALL2 CALL3 --out DIR   # merge calls

Each part (see ``--help`` for the list and order) runs in its own process (forked from a server
that imported torch and mixprec once: ``suite/launch.py``; ``--fresh-processes`` starts each
from scratch), in its own process group, with its own timeout; a part that fails, times out or
lacks a module is recorded with the reason and the suite goes on. ``--budget-min`` bounds the
whole call: a part starts only if its estimate fits the time left, and its timeout is cut to the
time left, so the suite ends by itself before an outer limit kills it. Every part inherits
``PYTHONPATH=src:...`` (the package runs from the working tree) plus the wheels found in
``--wheels`` (installed once per call).

Output (``--out``, flat, 4 files, names in ``[A-Za-z0-9._-]``, all rewritten as soon as
a part finishes, so a call killed at its limit still returns every finished part):

    results.json   every part's record: command, device name, torch/CUDA/Python/mixprec versions,
                   git commit, start/end, status (ok/failed/timeout/skipped + reason), figures,
                   judged goals, a table, the raw numbers its benchmark wrote
    summary.md     each goal beside its figure with MET / MISSED / NOT MEASURED, parts, figures,
                   failures with the tail of their logs
    logs.tar.gz    each part's full log and the files its benchmark wrote
    bench.png      `mixprec bench all --full`'s plot (part h), when it ran

``--summarize`` reads the results.json of several calls (folders or files) and writes one
merged results.json + summary.md: the session runs the parts in several device calls (10
minutes per command, 30 minutes in all) and builds the summary here. docs/gpu.md gives the
exact carry + run commands and a split of the parts into calls.

Adding a part (distributed, graph AMP under compile, FP8, ...) takes a few lines: write or reuse
a script that also runs at toy sizes on a CPU and writes JSON, then add a `Part` to `PARTS` in
``benchmarks/suite/parts.py``, with a reader in ``benchmarks/suite/extract.py``::

    def extract_fp8(ctx: Context, log: str) -> Figures:      # suite/extract.py
        rows = _load(ctx, "i.json")
        f = Figures(raw=rows, table=rows)
        f.put("fp8 / bf16 time", _ratio(rows[1]["ms"], rows[0]["ms"]))
        return f

    Part(                                                    # suite/parts.py, in PARTS
        name="i-fp8", title="FP8 matmul step vs bf16", priority=90, estimate_s=60,
        timeout_s=240,
        command=lambda ctx: [ctx.python, "benchmarks/fp8.py", "--json", ctx.path("i.json")]
        + (["--device", "cpu", "--steps", "1"] if ctx.smoke else []),
        extract=ex.extract_fp8,
        goals=(Goal("fp8 / bf16 time", "<=", 0.8, "FP8 step <= 0.8x bf16"),),
    ),

tests/test_gpu_suite.py runs ``--smoke``, so every registered part must run there, on a CPU,
within the suite's two-minute smoke budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.core import (
    FORMAT,
    Context,
    Part,
    Stopped,
    install_signal_handlers,
    merge,
    now,
    run_parts,
    write_json,
    write_text,
)
from suite.parts import PARTS, select
from suite.report import pack_logs, render_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_BUDGET_S = 120.0

_DEVICE_NOTES = """\
device limits this suite is built for (docs/gpu.md has the exact commands):
  - one command runs at most 10 minutes, a session has 30 minutes of device time, and the
    machine is bare again after 30 s idle: split the parts over calls with --only, give each
    call --budget-min 9, and merge the calls here with --summarize
  - no package index there: carry missing modules as wheels in .whl (--wheels); a part whose
    module is missing is skipped with the module's name and the recipe
  - what comes back from $OUT: at most 8 files, 2 folders deep, names [A-Za-z0-9._-]: the
    suite writes 4-5 flat files (results.json, summary.md, logs.tar.gz, bench.png)
  - the package is not installed there: every part gets PYTHONPATH=src (+ the wheels)"""


_STATUS_NOTES = """\
a part ends ok, failed (exit status, unreadable output, failing tests or variants: the figures
it has are kept), timeout, or skipped (missing module, budget); the suite goes on either way
and exits 0 only if every part it ran is ok. Goals: MET, MISSED, NOT MEASURED (why), NOT
JUDGED (a CPU run: the goals are GPU claims)."""


def _epilog() -> str:
    rows = [
        f"  {p.priority:3d}  {p.name:17s} ~{p.estimate_s / 60:4.1f} min (limit "
        f"{p.timeout_s / 60:.0f})  {p.title}"
        for p in sorted(PARTS, key=lambda p: p.priority)
    ]
    total = sum(p.estimate_s for p in PARTS) / 60
    return ("parts, in the order they run (priority, name, expected GPU time, timeout, what):\n"
            + "\n".join(rows) + f"\n  expected in all: ~{total:.0f} min of GPU time\n\n"
            + _DEVICE_NOTES + "\n\n" + _STATUS_NOTES + "\n\nexamples (one device session: "
            "three calls, then the merge here):\n"
            "  python3 benchmarks/gpu_suite.py --out $OUT --budget-min 9 --only a,b,c,d-mlp,e\n"
            "  python3 benchmarks/gpu_suite.py --out $OUT --budget-min 9 --only d-resnet50,d-gpt2\n"
            "  python3 benchmarks/gpu_suite.py --out $OUT --budget-min 9 --only f,g,h\n"
            "  python benchmarks/gpu_suite.py --smoke --out /tmp/smoke\n"
            "  python benchmarks/gpu_suite.py --summarize call1 call2 call3 --out merged\n"
            "  python benchmarks/gpu_suite.py --dry-run --only d")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gpu_suite.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every GPU measurement of mixprec (CUDA tests, autocast lists, sync "
        "checks, whole-step capture, scaler, autocast and opt-level costs, diagnostics, "
        "mixprec bench), each part in its own process with its own timeout; record each "
        "part's figures, status and goals as soon as it ends; write one markdown summary.",
        epilog=_epilog(),
    )  # fmt: skip
    ap.add_argument("--out", metavar="DIR",
                    help="output folder (created): results.json, summary.md, logs.tar.gz, "
                    "bench.png; earlier suite files there are replaced")  # fmt: skip
    ap.add_argument("--budget-min", type=float, default=25.0, metavar="MIN",
                    help="minutes this call may take (default 25; use 9 per device call): no "
                    "part starts unless its expected time fits what is left, and each part's "
                    "timeout is cut to what is left")  # fmt: skip
    ap.add_argument("--only", metavar="PARTS",
                    help="comma-separated part names or letters (a,b,d-gpt2,h); default: all, "
                    "in priority order")  # fmt: skip
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"every part at toy sizes on the CPU (the GPU is hidden), in under "
        f"{SMOKE_BUDGET_S / 60:.0f} minutes: checks that the suite still works",
    )
    ap.add_argument("--summarize", nargs="+", metavar="DIR",
                    help="merge the results.json of these call folders (or files) into one "
                    "results.json + summary.md in --out; runs nothing")  # fmt: skip
    ap.add_argument("--wheels", metavar="DIR", default=None,
                    help="install the *.whl in DIR for the parts (default: .whl in the "
                    "repository root, if it exists)")  # fmt: skip
    ap.add_argument("--commit", metavar="SHA",
                    help="the commit to record (default: git rev-parse HEAD, else .git read "
                    "by hand, else 'unknown')")  # fmt: skip
    ap.add_argument("--workdir", metavar="DIR",
                    help="scratch folder for the parts' logs and raw files (default: a new "
                    "temporary folder; packed into logs.tar.gz either way)")  # fmt: skip
    ap.add_argument(
        "--fresh-processes",
        action="store_true",
        help="start every part in a fresh interpreter (default: forked from one server that "
        "imported torch, torch._dynamo, inductor and mixprec once, about 5 s saved per part; "
        "each part still has its own process, process group, log and timeout)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the selected parts, their commands and times; run nothing",
    )
    return ap


OUTPUTS = ("results.json", "summary.md", "logs.tar.gz",
           *(dst for p in PARTS for _, dst in p.artefacts))  # fmt: skip


def _write_outputs(out: str, doc: dict[str, Any], work_root: str | None) -> None:
    write_json(os.path.join(out, "results.json"), doc)
    write_text(os.path.join(out, "summary.md"), render_summary(doc, PARTS))
    if work_root is not None:
        pack_logs(work_root, os.path.join(out, "logs.tar.gz"))


def summarize(sources: list[str], out: str) -> int:
    """Merge several calls' results.json (folders or files) into `out`."""
    docs = []
    for src in sources:
        path = os.path.join(src, "results.json") if os.path.isdir(src) else src
        try:
            with open(path) as fh:
                docs.append(json.load(fh))
        except (OSError, ValueError) as err:
            print(f"gpu_suite: error: cannot read {path}: {err}", file=sys.stderr)
            return 2
    try:
        doc = merge(docs)
    except (KeyError, ValueError) as err:
        print(f"gpu_suite: error: {err}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    _write_outputs(out, doc, None)
    for src in sources:  # the plot, from the call that made it
        for dst in (d for p in PARTS for _, d in p.artefacts):
            found = os.path.join(src, dst) if os.path.isdir(src) else ""
            if found and os.path.isfile(found):
                shutil.copy(found, os.path.join(out, dst))
    print(f"merged {len(docs)} call(s), {len(doc['parts'])} part(s) -> "
          f"{os.path.join(out, 'summary.md')}")  # fmt: skip
    return 0


def _report(doc: dict[str, Any]) -> int:
    verdicts = Counter(g["verdict"] for r in doc["parts"].values() for g in r["goals"])
    print("goals: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())))
    for r in doc["parts"].values():
        for g in r["goals"]:
            if g["verdict"] == "MISSED":
                print(f"  MISSED {r['part']}: {g['goal']}: {g['value']} (target {g['op']} "
                      f"{g['target']})")  # fmt: skip
    return 0 if all(r["status"] == "ok" for r in doc["parts"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.out and not args.dry_run:
        parser.error("--out DIR is required (where results.json and summary.md go)")
    if args.summarize:
        return summarize(args.summarize, args.out)
    parts = select(PARTS, args.only)
    if args.dry_run:
        for p in parts:
            ctx = Context(args.smoke, "cuda?", os.path.join("<work>", p.name), ROOT)
            print(f"{p.priority:3d} {p.name:17s} ~{p.estimate_s:.0f} s, limit {p.timeout_s:.0f}"
                  f" s: {shlex.join(p.command(ctx))}")  # fmt: skip
        print(f"expected: ~{sum(p.estimate_s for p in parts) / 60:.1f} min")
        return 0
    temps: list[str] = []  # scratch folders this call made (removed at the end)
    try:
        return _run(args, parts, argv, temps)
    finally:
        for path in temps:
            shutil.rmtree(path, ignore_errors=True)


def _temp(prefix: str, temps: list[str]) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    temps.append(path)
    return path


def _launcher(args: argparse.Namespace, env: dict[str, str],
              work_dir: str) -> tuple[Any, str]:  # fmt: skip
    """The preloading server the parts (and the probe) fork from, or None (fresh processes),
    with how parts start, in words."""
    from suite.launch import Preloaded

    fresh = "a fresh interpreter per part"
    if args.fresh_processes:
        return None, fresh
    try:
        launcher = Preloaded(env)
        broken = launcher.works(work_dir)
    except (OSError, ValueError) as err:
        broken = f"the preloading server did not start: {err}"
    if broken:  # parts start fresh, as with --fresh-processes
        return None, f"{fresh} ({broken})"
    return launcher, launcher.description


def _run(args: argparse.Namespace, parts: list[Part], argv: list[str] | None,
         temps: list[str]) -> int:  # fmt: skip
    """One call: prepare the parts' environment, run the parts, write the outputs."""
    from suite.env import git_commit, install_wheels, part_env, probe

    t0 = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    for name in OUTPUTS:  # earlier results must not mix with this call's
        for path in (os.path.join(args.out, name), os.path.join(args.out, name + ".tmp")):
            if os.path.exists(path):
                os.remove(path)
    work_root = args.workdir or _temp("gpu_suite_", temps)
    os.makedirs(work_root, exist_ok=True)
    default_wheels = os.path.join(ROOT, ".whl")
    wheel_dir = args.wheels or (default_wheels if os.path.isdir(default_wheels) else None)
    wheels, paths, wheel_note = install_wheels(wheel_dir, _temp("gpu_site_", temps))
    env = part_env(ROOT, paths, args.smoke)
    # The probe forks from the parts' server where it can: a fresh one imports torch again.
    launch_dir = os.path.join(work_root, "launcher")
    launcher, how = _launcher(args, env, launch_dir)
    info = probe(env, sorted({m for p in parts for m in p.requires}), ROOT, launcher, launch_dir)
    device = "cuda" if info.get("cuda_available") else "cpu"
    meta = {"mode": "smoke" if args.smoke else "full", "device": device,
            "device_name": info.get("device_name", "unknown"), "torch": info.get("torch"),
            "cuda": info.get("cuda"), "python": info.get("python"),
            "mixprec": info.get("mixprec"),
            "git_commit": git_commit(ROOT, args.commit)}  # fmt: skip
    call = {**meta, "command": shlex.join(["python", "benchmarks/gpu_suite.py",
                                           *(argv if argv is not None else sys.argv[1:])]),
            "started": now(), "ended": None, "duration_s": 0.0, "budget_min": args.budget_min,
            "wheels": wheels, "wheels_note": wheel_note, "launcher": how,
            "modules": info.get("modules", {}), "parts_run": []}  # fmt: skip
    doc: dict[str, Any] = {"format": FORMAT, "calls": [call], "parts": {}}
    fatal = info.get("probe_error") or info.get("torch_error") or info.get("mixprec_error")
    if fatal:
        call["fatal"] = f"the parts' environment is broken, nothing ran: {fatal}"
        _write_outputs(args.out, doc, work_root)
        print(f"gpu_suite: error: {call['fatal']}", file=sys.stderr)
        return 2
    print(f"{meta['device_name']} | torch {meta['torch']} | CUDA {meta['cuda']} | commit "
          f"{meta['git_commit'][:12]} | {meta['mode']} | {len(parts)} part(s), budget "
          f"{args.budget_min:g} min" + (f" | wheels: {', '.join(wheels)}" if wheels else ""),
          flush=True)  # fmt: skip

    def on_record(record: dict[str, Any]) -> None:
        doc["parts"][record["part"]] = record
        call["parts_run"].append(record["part"])
        call.update(ended=now(), duration_s=round(time.monotonic() - t0, 1))
        part = next(p for p in PARTS if p.name == record["part"])
        for src, dst in part.artefacts:
            found = os.path.join(work_root, part.name, src)
            if os.path.isfile(found):
                shutil.copy(found, os.path.join(args.out, dst))
        _write_outputs(args.out, doc, work_root)
        note = f": {record['reason'][:300]}" if record["reason"] else ""
        print(f"[{record['part']}] {record['status']} ({record['duration_s'] or 0:.1f} s){note}",
              flush=True)  # fmt: skip

    def make_ctx(part: Part) -> Context:
        return Context(args.smoke, device, os.path.join(work_root, part.name), ROOT)

    install_signal_handlers()  # from here on, a SIGTERM still writes what is finished
    try:
        run_parts(parts, make_ctx=make_ctx, env=env, budget_s=args.budget_min * 60,
                  started=t0, meta=meta, modules=info.get("modules", {}),
                  on_record=on_record, launcher=launcher)  # fmt: skip
    except Stopped as why:
        call["stopped"] = f"stopped by {why}"
        _write_outputs(args.out, doc, work_root)
        print(f"gpu_suite: stopped by {why}; finished parts are in {args.out}", file=sys.stderr)
        return 124
    call.update(ended=now(), duration_s=round(time.monotonic() - t0, 1))
    _write_outputs(args.out, doc, work_root)
    print(f"{len(doc['parts'])} part(s) in {call['duration_s']:.0f} s -> "
          f"{os.path.join(args.out, 'summary.md')}")  # fmt: skip
    return _report(doc)


if __name__ == "__main__":
    raise SystemExit(main())
