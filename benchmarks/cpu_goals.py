"""Every CPU speed goal of mixprec, measured and judged by one command.

    python benchmarks/cpu_goals.py --out DIR [--only step,bench,o4,tests] [--budget-min 60]
    python benchmarks/cpu_goals.py --smoke --out /tmp/cpu-smoke     # toy sizes: the machinery
    python benchmarks/cpu_goals.py --dry-run

The CPU counterpart of ``gpu_suite.py``, on the same machinery (``benchmarks/suite/core.py``):
each part is an existing benchmark run in a fresh process of its own, with its own timeout;
its JSON is read into figures, each goal is judged beside its figure (MET, MISSED, NOT
MEASURED with the reason, NOT JUDGED), and ``DIR`` gets ``results.json`` and ``summary.md``.
Run it quietly (nothing else on the machine): the parts are timings.

The goals are the open speed promises that a CPU can settle (CHANGELOG and docs/results.md
say where each comes from):

- ``step``: the compiled whole step (`mixprec.TrainStep`) against torch.amp eager and
  torch.amp + ``torch.compile(model)`` on the seed MLP, ResNet-50 (CIFAR) and the GPT-2-like
  decoder (``cpu_step.py``), its first compile and its recompilations under an LR schedule;
- ``bench``: the README's first command, ``mixprec bench``, at its defaults with an empty
  compile cache: its wall time and whether the fastest mixprec row beats fp32 everywhere;
- ``o4``: the 6-byte training state's step (O4) against O2's (``low_memory.py --speed``);
- ``tests``: the README's test command, timed.

The speed-up goals of ``step`` and ``bench`` are promises about a CPU whose 16-bit matmuls are
fast: on a CPU where bf16 matmuls run slower than fp32's (AVX2 without AVX512-BF16 or AMX),
their figures are shown and not judged. The probe at the start measures both rates and says
which case this is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.core import Context, Figures, Goal, Part, now, run_parts, write_json, write_text
from suite.parts import select
from suite.report import render_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMAT = "mixprec-cpu-goals/1"
FAST = "fast-bf16"
TRAINSTEP = ("TrainStep O1", "TrainStep O2")
MIXPREC_BENCH_ROWS = ("O1", "O2", "O3", "trainstep")


def _timed(ctx: Context, argv: list[str], **env: str) -> list[str]:
    """`argv` (with `env` added to its environment) run by this script's ``--time-to`` mode,
    which writes its wall time, interpreter start-up included, to the part's seconds.json."""
    sets = [x for k, v in env.items() for x in ("--set-env", f"{k}={v}")]
    return [ctx.python, "benchmarks/cpu_goals.py", "--time-to", ctx.path("seconds.json"), *sets,
            "--", *argv]  # fmt: skip


def _time_command(argv: list[str]) -> int:
    """``--time-to FILE [--set-env K=V ...] -- COMMAND...``: run COMMAND, write its seconds."""
    if "--" not in argv or len(argv) < 4 or argv.index("--") == len(argv) - 1:
        raise SystemExit("cpu_goals: error: --time-to needs FILE, then -- and a command "
                         "(the parts' timing wrapper; run the script without it)")  # fmt: skip
    out, env, rest = argv[1], dict(os.environ), argv[2:]
    while rest[:1] == ["--set-env"]:
        key, _, value = rest[1].partition("=")
        env[key], rest = value, rest[2:]
    command = rest[1:] if rest[:1] == ["--"] else rest
    start = time.perf_counter()
    rc = subprocess.call(command, env=env)
    write_json(out, time.perf_counter() - start)
    return rc


def _load(ctx: Context, name: str) -> Any:
    with open(ctx.path(name)) as fh:
        return json.load(fh)


def _seconds(ctx: Context) -> float | None:
    try:
        return float(_load(ctx, "seconds.json"))
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ the parts


def extract_step(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "step.json")
    rows = {(r["workload"], r["variant"]): r for r in doc["rows"]}
    f = Figures(raw=doc["meta"])
    f.table = [{"workload": w, "variant": v, "ms/step": r["ms_per_step"],
                "vs torch.amp": r["vs_torch_amp"], "vs fp32": r["vs_fp32"],
                "warm-up s": r["build_and_warmup_s"],
                "recompiles": r.get("graphs_compiled_after_warmup")}
               for (w, v), r in rows.items()]  # fmt: skip
    ran = list(dict.fromkeys(w for w, _ in rows))  # in cpu_step's order
    for workload in ("mlp", "resnet50", "gpt2"):
        if workload not in ran:
            why = f"{workload} was not run (cpu_step.py --workloads)"
            f.put(f"{workload}: TrainStep / torch.amp eager", None, why)
            f.put(f"{workload}: TrainStep / torch.amp+compile", None, why)
    for workload in ran:
        amp, compiled = rows.get((workload, "torch.amp")), rows.get((workload, "torch.amp+compile"))
        steps = [rows[(workload, v)] for v in TRAINSTEP if (workload, v) in rows]
        # GPT-2's goals are O1's; the others take the better TrainStep level.
        if workload == "gpt2":
            steps = steps[:1]
        if not (amp and compiled and steps):
            continue
        best = min(steps, key=lambda r: r["ms_per_step"])
        f.put(f"{workload}: TrainStep / torch.amp eager", amp["ms_per_step"] / best["ms_per_step"])
        # How far the machine drifted: the same ratio within each round.
        rounds = best.get("vs_torch_amp_rounds") or []
        if rounds:
            f.put(f"{workload}: TrainStep / torch.amp eager, lowest round", min(rounds))
            f.put(f"{workload}: TrainStep / torch.amp eager, highest round", max(rounds))
        best = best["ms_per_step"]
        f.put(f"{workload}: TrainStep / torch.amp+compile", compiled["ms_per_step"] / best)
        if workload == "gpt2":
            f.put(
                "gpt2: TrainStep share of the bf16 matmul rate %",
                steps[0]["pct_of_low_matmul_rate"],
            )
            f.put("gpt2: TrainStep first compile s", steps[0]["build_and_warmup_s"])
    counts = [r.get("graphs_compiled_after_warmup") for (_, v), r in rows.items()
              if v in TRAINSTEP]  # fmt: skip
    counts = [c for c in counts if c is not None]
    f.put(
        "TrainStep recompilations under the LR schedule (most)",
        max(counts) if counts else None,
        "no TrainStep row ran the schedule",
    )
    return f


def extract_bench(ctx: Context, log: str) -> Figures:
    rows = _load(ctx, "bench.json")
    f = Figures(raw={k: rows[0].get(k) for k in ("statement", "low_vs_fp32_rate", "elapsed_s",
                                                  "outside_budget_s", "budget_s")})  # fmt: skip
    worst = None
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ok = [r for r in rows if r["workload"] == workload and r["status"] == "ok"]
        fp32 = [r["ms_per_step"] for r in ok if r["variant"] == "fp32"]
        ours = [r for r in ok if r["variant"] in MIXPREC_BENCH_ROWS]
        if not fp32 or not ours:
            continue
        fastest = min(ours, key=lambda r: r["ms_per_step"])
        speedup = fp32[0] / fastest["ms_per_step"]
        f.table.append({"workload": workload, "size": fastest["size"], "fp32 ms": fp32[0],
                        "fastest mixprec row": fastest["variant"],
                        "its ms": fastest["ms_per_step"], "x fp32": speedup})  # fmt: skip
        worst = speedup if worst is None else min(worst, speedup)
    f.put("fastest mixprec row / fp32, worst workload", worst, "no workload had both rows")
    f.put("first run s (empty compile cache)", _seconds(ctx))
    f.put("bf16 / fp32 matmul rate", rows[0].get("low_vs_fp32_rate"))
    return f


def extract_o4(ctx: Context, log: str) -> Figures:
    speed = _load(ctx, "o4.json")["speed"]
    f = Figures(raw=speed)
    f.table = [{"variant": k, "median ms": v["median_ms"], "compiled": v["compiled"]}
               for k, v in speed.items() if isinstance(v, dict)]  # fmt: skip
    f.put("O4 / O2 step time", speed.get("O4_over_O2"), "O2 or O4 did not run")
    rounds = speed.get("O4_over_O2_rounds") or []
    median = statistics.median(rounds) if rounds else None
    f.put("O4 / O2, round by round: median", median, "no rounds")
    # O4 with optimizer_states='8bit' (exact block maxima, a second compiled pass): reported
    # beside the goal's figure, which stays O4's own.
    f.put("O4 (8bit) / O2 step time", speed.get("O4-exact_over_O2"),
          "O4-exact did not run")  # fmt: skip
    return f


def extract_tests(ctx: Context, log: str) -> Figures:
    f = Figures()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", log)}
    f.raw = counts
    f.put("test suite wall s", _seconds(ctx))
    f.put("tests passed", counts.get("passed"), "no pytest summary in the log")
    if counts.get("failed") or counts.get("error") or counts.get("errors"):
        f.problems.append(f"tests failed: {counts}")
    return f


def _step_cmd(ctx: Context) -> list[str]:
    smoke = ["--smoke", "--workloads", "gpt2", "--rounds", "1", "--warmup", "2",
             "--schedule-steps", "2"]  # fmt: skip
    # An empty inductor cache: the first compile is timed as a new user's first run pays it.
    argv = [ctx.python, "benchmarks/cpu_step.py", "--json", ctx.path("step.json"),
            *(smoke if ctx.smoke else [])]  # fmt: skip
    return _timed(ctx, argv, TORCHINDUCTOR_CACHE_DIR=ctx.path("inductor-cache"))


def _bench_cmd(ctx: Context) -> list[str]:
    # An empty inductor cache: the README's first run on a new machine compiles everything.
    smoke = ["mlp", "--steps", "1", "--warmup", "0", "--variants", "fp32,O1"]
    return _timed(ctx, [ctx.python, "-m", "mixprec", "bench", "--json", ctx.path("bench.json"),
                        *(smoke if ctx.smoke else [])],
                  TORCHINDUCTOR_CACHE_DIR=ctx.path("inductor-cache"))  # fmt: skip


def _o4_cmd(ctx: Context) -> list[str]:
    rounds = ["--speed-rounds", "1", "--speed-steps", "1"] if ctx.smoke else ["--speed-rounds",
                                                                            "15"]  # fmt: skip
    return [ctx.python, "benchmarks/low_memory.py", "--tasks", "", "--speed", *rounds,
            "--json", ctx.path("o4.json"), "--table", ctx.path("o4.md")]  # fmt: skip


def _tests_cmd(ctx: Context) -> list[str]:
    # The README's test command (without its installs); a smoke run takes one small file.
    which = ["tests/test_policy.py"] if ctx.smoke else ["-n", "2", "--dist", "loadfile"]
    return _timed(ctx, [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *which])


def _goal(figure: str, op: str, target: float, text: str, needs: str = FAST) -> Goal:
    return Goal(figure, op, target, text, cuda_only=False, needs=needs)


# (figure, op, target, goal): issue 23's speed-ups, promises about a CPU with fast bf16.
_STEP_GOALS = (
    ("gpt2: TrainStep / torch.amp eager", ">=", 1.5,
     "GPT-2-like: TrainStep O1 >= 1.5x torch.amp eager"),
    ("gpt2: TrainStep / torch.amp+compile", ">=", 1.3,
     "GPT-2-like: TrainStep O1 >= 1.3x torch.amp + compile(model)"),
    ("mlp: TrainStep / torch.amp eager", ">=", 1.2, "seed MLP: TrainStep >= 1.2x torch.amp eager"),
    ("mlp: TrainStep / torch.amp+compile", ">=", 1.0,
     "seed MLP: TrainStep never slower than torch.amp + compile(model)"),
    ("resnet50: TrainStep / torch.amp eager", ">=", 1.2,
     "ResNet-50 (CIFAR): TrainStep >= 1.2x torch.amp eager"),
    ("resnet50: TrainStep / torch.amp+compile", ">=", 1.0,
     "ResNet-50 (CIFAR): TrainStep never slower than torch.amp + compile(model)"),
    ("gpt2: TrainStep first compile s", "<=", 60, "first compile of the GPT-2-like step <= 60 s"),
)  # fmt: skip

PARTS = [
    Part(
        name="step",
        title="the whole step compiled (TrainStep) vs torch.amp, cpu_step.py",
        priority=10,
        estimate_s=1200,
        timeout_s=3000,
        command=_step_cmd,
        extract=extract_step,
        goals=(
            *(_goal(*g) for g in _STEP_GOALS),
            _goal(
                "TrainStep recompilations under the LR schedule (most)",
                "==",
                0,
                "no recompilation across 100 steps of an LR schedule",
                needs="",
            ),
        ),
    ),
    Part(
        name="bench",
        title="the README's first command at its defaults, cold compile cache",
        priority=20,
        estimate_s=240,
        timeout_s=1200,
        command=_bench_cmd,
        extract=extract_bench,
        goals=(
            _goal(
                "fastest mixprec row / fp32, worst workload",
                ">",
                1.0,
                "mixprec bench defaults: the fastest mixprec row beats fp32 on every workload",
            ),
            _goal(
                "first run s (empty compile cache)",
                "<",
                120,
                "mixprec bench's first run < 2 min, compile included",
            ),
        ),
    ),
    Part(
        name="o4",
        title="6-byte training state (O4) vs O2, compiled steps, low_memory.py",
        priority=30,
        estimate_s=90,
        timeout_s=600,
        command=_o4_cmd,
        extract=extract_o4,
        goals=(
            _goal(
                "O4 / O2 step time",
                "<=",
                1.15,
                "the 6-byte configuration's step <= 1.15x O2's",
                needs="",
            ),
        ),
    ),
    Part(
        name="tests",
        title="the README's test command (pytest -n 2), timed",
        priority=40,
        estimate_s=600,
        timeout_s=1800,
        command=_tests_cmd,
        extract=extract_tests,
        goals=(
            _goal(
                "test suite wall s", "<=", 360, "the whole test suite <= 6 min on 2 cores", needs=""
            ),
        ),
    ),
]


# ------------------------------------------------------------------------------ the driver


def probe() -> tuple[dict[str, Any], dict[str, str]]:
    """This CPU (name, threads, flags, bf16 and fp32 matmul rates) and the capabilities it
    lacks, each with the measurement that says so."""
    import torch

    import mixprec
    from mixprec.bench.budget import measure_peak
    from mixprec.bench.report import cpu_name

    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as fh:
            line = next((x for x in fh if x.startswith("flags")), "")
        wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
        flags = [f for f in line.split(":", 1)[-1].split() if f in wanted]
    except OSError:
        pass
    fp32, bf16 = (measure_peak("cpu", name).gflops for name in ("fp32", "bf16"))
    info = {"device_name": cpu_name(), "threads": torch.get_num_threads(), "flags": flags,
            "torch": torch.__version__, "python": sys.version.split()[0],
            "mixprec": mixprec.__version__,
            "matmul_gflops": {"fp32": round(fp32, 1), "bf16": round(bf16, 1)}}  # fmt: skip
    lacks = {}
    if bf16 < fp32:
        lacks[FAST] = (f"this CPU's bf16 matmuls run at {bf16 / fp32:.2g}x fp32's rate "
                       f"({bf16:.0f} vs {fp32:.0f} GFLOP/s; flags: {' '.join(flags) or 'none'}"
                       f"): the goal is a claim about a CPU with fast bf16")  # fmt: skip
    return info, lacks


def _parser() -> argparse.ArgumentParser:
    rows = "\n".join(f"  {p.name:6s} ~{p.estimate_s / 60:4.0f} min (limit {p.timeout_s / 60:.0f})"
                     f"  {p.title}" for p in PARTS)  # fmt: skip
    ap = argparse.ArgumentParser(
        prog="cpu_goals.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure and judge mixprec's CPU speed goals (the whole compiled step vs "
        "torch.amp, mixprec bench's first run, O4 vs O2, the test suite's time), each part "
        "an existing benchmark in its own process; write results.json and summary.md.",
        epilog="parts, in the order they run (expected time on a 2-core CPU, limit):\n" + rows
        + "\n\nGoals: MET, MISSED, NOT MEASURED (why), NOT JUDGED (a speed-up goal on a CPU "
        "whose bf16 matmuls are slower than fp32's: the probe says so). Run it with nothing "
        "else on the machine.",
    )  # fmt: skip
    ap.add_argument("--out", metavar="DIR", help="output folder: results.json, summary.md")
    ap.add_argument("--only", metavar="PARTS", help="comma-separated part names (default: all)")
    ap.add_argument("--budget-min", type=float, default=90.0, metavar="MIN",
                    help="minutes this run may take (default 90): a part starts only if its "
                    "expected time fits what is left")  # fmt: skip
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="toy sizes: checks the machinery in a few minutes, judges nothing real",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--time-to"]:  # the timing wrapper of a part (`_timed`), not for people
        return _time_command(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.out and not args.dry_run:
        parser.error("--out DIR is required (where results.json and summary.md go)")
    parts = select(PARTS, args.only, prog="cpu_goals")
    if args.dry_run:
        for p in parts:
            ctx = Context(args.smoke, "cpu", os.path.join("<work>", p.name), ROOT)
            print(f"{p.name:6s} ~{p.estimate_s:.0f} s: {shlex.join(p.command(ctx))}")
        return 0
    from suite.env import git_commit, part_env

    t0 = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="cpu_goals_")
    info, lacks = probe()
    meta = {"mode": "smoke" if args.smoke else "full", "device": "cpu", **info,
            "git_commit": git_commit(ROOT, None)}  # fmt: skip
    call = {**meta, "command": shlex.join(["python", "benchmarks/cpu_goals.py",
                                           *argv]),
            "started": now(), "lacks": lacks, "parts_run": []}  # fmt: skip
    doc: dict[str, Any] = {"format": FORMAT, "calls": [call], "parts": {}}
    print(f"{info['device_name']} | {info['threads']} threads | flags "
          f"{' '.join(info['flags']) or '-'} | matmul GFLOP/s fp32 "
          f"{info['matmul_gflops']['fp32']}, bf16 {info['matmul_gflops']['bf16']} | torch "
          f"{info['torch']} | {len(parts)} part(s)", flush=True)  # fmt: skip

    def write() -> None:
        write_json(os.path.join(args.out, "results.json"), doc)
        write_text(os.path.join(args.out, "summary.md"),
                   render_summary(doc, PARTS, title="CPU goals",
                                  smoke_note="its verdicts say nothing"))  # fmt: skip

    def on_record(record: dict[str, Any]) -> None:
        doc["parts"][record["part"]] = record
        call["parts_run"].append(record["part"])
        call.update(ended=now(), duration_s=round(time.monotonic() - t0, 1))
        write()
        note = f": {record['reason'][:300]}" if record["reason"] else ""
        print(f"[{record['part']}] {record['status']} ({record['duration_s'] or 0:.0f} s){note}",
              flush=True)  # fmt: skip
        for g in record["goals"]:
            print(f"    {g['verdict']:12s} {g['goal']}: {g['value']}")

    try:
        run_parts(parts, make_ctx=lambda p: Context(args.smoke, "cpu", os.path.join(work, p.name),
                                                    ROOT),
                  env=part_env(ROOT, [], args.smoke), budget_s=args.budget_min * 60, started=t0,
                  meta=meta, modules={}, on_record=on_record, lacks=lacks)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write()
    print(f"-> {os.path.join(args.out, 'summary.md')}")
    return 0 if all(r["status"] == "ok" for r in doc["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
