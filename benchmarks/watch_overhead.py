"""What `mixprec.watch_nonfinite` costs per training step, side by side in one run.

For each bench workload, one O1 training step (mixprec.autocast + GradScaler + optimizer) is
timed without a watch, with ``watch_nonfinite(model, ops=False)`` (module outputs, input and
parameter gradients) and with ``ops=True`` (also every aten op output). Rounds interleave the
three variants so drifting machine load hits them alike; the table shows the median ms/step
and the ratio to the unwatched step. On CUDA the watched steps also run under
``torch.cuda.set_sync_debug_mode('error')``: any host-device sync in the hooks raises.

Usage::

    python benchmarks/watch_overhead.py [--device auto|cpu|cuda] [--rounds 5] [--batch N]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

import mixprec
from mixprec.bench.report import cpu_name
from mixprec.bench.workloads import WORKLOADS, WorkloadSize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

VARIANTS = ("no watch", "watch ops=False", "watch ops=True")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step_fn(name: str, device: str, batch: int | None = None):
    workload = WORKLOADS[name]
    size = workload.size(False, device)
    if batch:
        size = WorkloadSize(f"{size.description}; batch set to {batch}", size.steps,
                            size.warmup, {**size.params, "batch": batch})  # fmt: skip
    model, batch = workload.build(size.params, device)
    opt = workload.optimizer(model, device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    scaler = mixprec.GradScaler(device, enabled=dtype is torch.float16)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast(device, dtype=dtype):
            loss = workload.loss(model(batch[0]), batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return model, step, size


def _watch(variant: str, model: torch.nn.Module):
    if variant == "no watch":
        return contextlib.nullcontext()
    return mixprec.watch_nonfinite(model, ops=variant.endswith("True"))


def _no_sync(device: str, variant: str):
    if device == "cuda" and variant != "no watch":
        return _SyncGuard()
    return contextlib.nullcontext()


class _SyncGuard:
    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


def measure(name: str, device: str, rounds: int, steps: int,
            batch: int | None = None) -> list[dict]:  # fmt: skip
    model, step, size = _step_fn(name, device, batch)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for variant in VARIANTS:  # warm-up (allocator, first-use casts, the watch's mask)
        with _watch(variant, model):
            for _ in range(2):
                step()
            _sync(device)
    for _ in range(rounds):
        for variant in VARIANTS:
            with _watch(variant, model) as watch:
                _sync(device)
                start = time.perf_counter()
                with _no_sync(device, variant):
                    for _ in range(steps):
                        step()
                _sync(device)
                times[variant].append((time.perf_counter() - start) * 1e3 / steps)
                if watch is not None:
                    assert watch.first is None, f"{name}: unexpected non-finite: {watch.first}"
    base = statistics.median(times["no watch"])
    return [{
        "workload": name, "size": size.description, "variant": v,
        "ms_per_step": statistics.median(times[v]),
        "ratio": statistics.median(times[v]) / base,
        "rounds": times[v],
    } for v in VARIANTS]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda where available, else cpu; cuda steps run in fp16 with the watched "
        "ones under sync debug mode 'error', cpu steps in bf16 (default: %(default)s)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated bench workloads, from: {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help=f"interleaved rounds of the variants ({', '.join(VARIANTS)}); the median ms/step "
        "is reported (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per round (5 CPU, 20 GPU)")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size instead of the workload's (toy sizes for smoke runs)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the metadata and one row per workload and variant (ms/step, ratio to no "
        "watch, every round's time) as JSON",
    )
    args = parser.parse_args(argv)
    workloads = comma_list(parser, "--workloads", args.workloads, list(WORKLOADS))
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    steps = args.steps or (20 if device == "cuda" else 5)
    rows = []
    for name in workloads:
        rows += measure(name, device, args.rounds, steps, args.batch)
        print(f"measured {name}", file=sys.stderr)
    where = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    print(f"{where} | torch {torch.__version__} | mixprec {mixprec.__version__}")
    print(f"{'workload':<10} {'variant':<17} {'ms/step':>9} {'x no watch':>11}")
    for r in rows:
        print(
            f"{r['workload']:<10} {r['variant']:<17} {r['ms_per_step']:>9.2f} {r['ratio']:>10.2f}x"
        )
    if args.json:
        meta = {"command": "python " + " ".join(sys.argv), "device": where,
                "torch": torch.__version__, "mixprec": mixprec.__version__,
                "python": platform.python_version()}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
