"""Per-step cost of mixprec.autocast against torch.autocast, measured side by side in one run.

Two workloads (forward + loss + backward, no optimizer):

- dispatch-bound: 20 x (Linear(64, 64) + ReLU), batch 8, on the CPU in bf16. The step is a few
  milliseconds of tiny kernels, so every microsecond of Python per op shows. Goal: mixprec /
  torch <= 1.15.
- GPU-bound (CUDA; ``--device cpu`` runs it on the CPU in bf16, at toy ``--width``/``--batch``
  for smoke runs): the seed MLP, 3 x Linear(4096) + ReLU at batch 8192, fp16. Goal: within 2%
  of torch.autocast.

Rows: fp32 (no autocast), torch.autocast, mixprec.autocast, mixprec.autocast without the
weight-cast cache, and "torch.autocast + an empty TorchFunctionMode": the cost every Python-level
mode pays per call before doing anything, i.e. the floor for any engine built the way mixprec is.

Method: the variants run in interleaved blocks (A B C ... then reversed), many rounds; each
round gives a ratio to the torch.autocast blocks of the same round, and the table reports the
median ratio and its interquartile range, which is robust to the drift of a shared machine.

Usage::

    python benchmarks/autocast_overhead.py                 # CPU workload (+ CUDA if present)
    python benchmarks/autocast_overhead.py --rounds 60 --json results/autocast_overhead.json
    python benchmarks/autocast_overhead.py --workloads gpu-bound        # the GPU goal only

The exit status is 1 when a goal is missed (the JSON is written first).
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
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import mixprec
from mixprec.bench.report import cpu_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list


class _EmptyMode(TorchFunctionMode):
    """Does nothing but pass each call on: the dispatch cost of any Python-level mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)


@contextlib.contextmanager
def _torch_plus_empty_mode(device: str, dtype: torch.dtype):
    with torch.autocast(device, dtype=dtype), _EmptyMode():
        yield


def _variants(device: str, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    return {
        "fp32": contextlib.nullcontext,
        "torch.autocast": lambda: torch.autocast(device, dtype=dtype),
        "mixprec.autocast": lambda: mixprec.autocast(device, dtype=dtype),
        "mixprec.autocast (no weight cache)": lambda: mixprec.autocast(
            device, dtype=dtype, cache_enabled=False
        ),
        "torch.autocast + empty mode (floor)": lambda: _torch_plus_empty_mode(device, dtype),
    }


def _workload(name: str, device: str, width: int = 4096, batch: int = 8192):
    torch.manual_seed(0)
    if name == "dispatch-bound":
        layers: list[torch.nn.Module] = []
        for _ in range(20):
            layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers).to(device), torch.randn(8, 64, device=device)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device), torch.randn(batch, width, device=device)


def _measure(name: str, device: str, dtype: torch.dtype, rounds: int, steps: int,
             **size: int) -> dict:  # fmt: skip
    model, x = _workload(name, device, **size)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(ctx: Callable[[], Any]) -> None:
        with ctx():
            loss = model(x).float().pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    def block(ctx: Callable[[], Any]) -> float:
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            step(ctx)
        sync()
        return (time.perf_counter() - t) / steps

    variants = _variants(device, dtype)
    for ctx in variants.values():  # warm-up: kernels, allocator, mixprec's tables
        block(ctx)
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        got = {n: block(variants[n]) for n in order}
        for n in names:
            times[n].append(got[n])
            ratios[n].append(got[n] / got["torch.autocast"])
    rows = []
    for n in names:
        q = statistics.quantiles(ratios[n], n=4)
        rows.append({
            "workload": name, "variant": n, "device": device,
            "dtype": "torch.float32" if n == "fp32" else str(dtype),
            "ms_per_step": statistics.median(times[n]) * 1e3,
            "ratio_vs_torch_autocast": statistics.median(ratios[n]),
            "ratio_q25": q[0], "ratio_q75": q[2],
        })  # fmt: skip
    shape = "20 x Linear(64), batch 8" if name == "dispatch-bound" else \
        f"3 x Linear({x.shape[1]}), batch {x.shape[0]}"  # fmt: skip
    return {"workload": name, "size": shape, "device": device, "rounds": rounds, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated: dispatch-bound, gpu-bound (default: "
                        "dispatch-bound, plus gpu-bound when CUDA is available)")  # fmt: skip
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="device of the gpu-bound workload (auto: cuda if available); "
                        "the dispatch-bound one always runs on the CPU")  # fmt: skip
    parser.add_argument("--width", type=int, default=4096, help="gpu-bound MLP width (4096)")
    parser.add_argument("--batch", type=int, default=8192, help="gpu-bound batch (8192)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    default = "dispatch-bound,gpu-bound" if torch.cuda.is_available() else "dispatch-bound"
    given = default if args.workloads is None else args.workloads
    names = comma_list(parser, "--workloads", given, ("dispatch-bound", "gpu-bound"))

    results = []
    goals = {"dispatch-bound": 1.15, "gpu-bound": 1.02}
    if "dispatch-bound" in names:
        results.append(_measure("dispatch-bound", "cpu", torch.bfloat16, args.rounds, args.steps))
    if "gpu-bound" in names:
        # fp16 on a GPU; on a CPU (a smoke run) bf16, since CPU fp16 matmuls are ~100x slower.
        # A GPU step is ~10 ms at the default size: fewer rounds and steps give as tight a ratio.
        gpu = device == "cuda"
        dtype = torch.float16 if gpu else torch.bfloat16
        rounds = max(args.rounds // 3, 5) if gpu else args.rounds
        results.append(_measure("gpu-bound", device, dtype, rounds, 10 if gpu else args.steps,
                                width=args.width, batch=args.batch))  # fmt: skip

    print(f"torch {torch.__version__}, Python {platform.python_version()}, {cpu_name()}, "
          f"{torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))  # fmt: skip
    ok = True
    for res in results:
        print(
            f"\n{res['workload']}, {res['size']}, {res['device']}  (ratio = variant / "
            f"torch.autocast, median [IQR] of {res['rounds']} interleaved rounds)"
        )
        print(f"  {'variant':38s} {'ms/step':>9s} {'ratio':>7s}   IQR")
        for row in res["rows"]:
            print(
                f"  {row['variant']:38s} {row['ms_per_step']:9.3f} "
                f"{row['ratio_vs_torch_autocast']:7.3f}   "
                f"[{row['ratio_q25']:.3f}, {row['ratio_q75']:.3f}]"
            )
        mine = next(r for r in res["rows"] if r["variant"] == "mixprec.autocast")
        goal = goals[res["workload"]]
        met = mine["ratio_vs_torch_autocast"] <= goal
        ok &= met
        print(
            f"  goal mixprec/torch <= {goal}: {'met' if met else 'NOT met'} "
            f"({mine['ratio_vs_torch_autocast']:.3f})"
        )
    if args.json:
        meta = {
            "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cpu": cpu_name(),
            "cpu_threads": torch.get_num_threads(),
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
