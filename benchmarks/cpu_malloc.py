"""A CPU training step with the C allocator as it is, and with `mixprec.keep_cpu_memory`.

The setting is process-wide, so each measurement runs in its own process: for every workload
and variant, a process with the system allocator and one with freed memory kept take turns for
``--rounds`` rounds (so a burst of load from elsewhere slows both alike). Each process builds
the variant, warms it up (TrainStep compiles), then times ``--steps`` steps and counts the minor
page faults they took (the kernel's count, ``getrusage``): fresh pages faulted in.

Workloads and variants are `benchmarks/cpu_step.py`'s (the seed MLP, ResNet-50 at CIFAR size,
the GPT-2-like decoder; ``torch.amp`` eager and ``TrainStep O1`` by default). The table gives
the median ms/step and faults per step of each setting, and kept / system (above 1: faster
with the memory kept).

Usage::

    python benchmarks/cpu_malloc.py --json benchmarks/results/cpu_malloc_cpu.json
    python benchmarks/cpu_malloc.py --workloads mlp --rounds 1 --steps 3 --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import mixprec
from mixprec.bench.report import cpu_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: cpu_step, suite
from suite.args import comma_list

SETTINGS = ("system", "keep")


def child(workload: str, variant: str, setting: str, steps: int, smoke: bool) -> dict[str, Any]:
    """One process's measurement (the setting is made before anything is allocated)."""
    memory = mixprec.keep_cpu_memory() if setting == "keep" else None
    import cpu_step

    step, _ = cpu_step._build(variant, cpu_step._workloads(smoke)[workload], torch.bfloat16)
    for _ in range(3):  # TrainStep compiles in its first two
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(steps):
        step().item()
    ms = (time.perf_counter() - start) / steps * 1e3
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps
    return {"ms_per_step": ms, "page_faults_per_step": faults,
            "setting": str(memory) if memory else "system"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="mlp,resnet50,gpt2",
                        help="comma-separated: mlp, resnet50, gpt2 (default: all)")  # fmt: skip
    parser.add_argument("--variants", default="torch.amp,TrainStep O1",
                        help="comma-separated, from benchmarks/cpu_step.py's (default: "
                             "torch.amp,TrainStep O1)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="processes per setting (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps each (default: 20)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a test of the script)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "VARIANT", "SETTING"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps: give at least 1")
    if args.child:
        print(json.dumps(child(*args.child, steps=args.steps, smoke=args.smoke)))
        return 0
    import cpu_step

    workloads = comma_list(parser, "--workloads", args.workloads, list(cpu_step._workloads(True)))
    variants = comma_list(parser, "--variants", args.variants, cpu_step.VARIANTS)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"system allocator vs keep_cpu_memory, one process per measurement",
          flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        for variant in variants:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
            for _ in range(args.rounds):
                for setting in SETTINGS:
                    command = [sys.executable, os.path.abspath(__file__), "--child", workload,
                               variant, setting, "--steps", str(args.steps)]  # fmt: skip
                    if args.smoke:
                        command.append("--smoke")
                    runs[setting].append(_in_process(command))
            row: dict[str, Any] = {"workload": workload, "variant": variant}
            for setting in SETTINGS:
                row[f"{setting}_ms"] = statistics.median(r["ms_per_step"] for r in runs[setting])
                row[f"{setting}_faults"] = statistics.median(
                    r["page_faults_per_step"] for r in runs[setting]
                )
                row[f"{setting}_runs"] = runs[setting]
            row["kept_speedup"] = row["system_ms"] / row["keep_ms"]
            rows.append(row)
            print(f"  {workload:9s} {variant:14s} system {row['system_ms']:7.2f} ms "
                  f"({row['system_faults']:6.0f} faults)  kept {row['keep_ms']:7.2f} ms "
                  f"({row['keep_faults']:6.0f} faults)  kept/system {row['kept_speedup']:.2f}x",
                  flush=True)  # fmt: skip
    _ratios(rows, variants)
    if args.json:
        meta = {
            "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "libc": " ".join(platform.libc_ver()),
            "rounds": args.rounds, "steps": args.steps,
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _in_process(command: list[str]) -> dict[str, Any]:
    """Run one child measurement in a fresh process; its JSON result."""
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratios(rows: list[dict[str, Any]], variants: list[str]) -> None:
    """Each variant against the first, under each setting (what a comparison would show)."""
    if len(variants) < 2:
        return
    base = variants[0]
    print(f"\nvs {base}, same setting (medians of separate processes):")
    for row in rows:
        if row["variant"] == base:
            continue
        ref = next(r for r in rows if r["workload"] == row["workload"] and r["variant"] == base)
        print(f"  {row['workload']:9s} {row['variant']:14s} system "
              f"{ref['system_ms'] / row['system_ms']:.2f}x, kept "
              f"{ref['keep_ms'] / row['keep_ms']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
