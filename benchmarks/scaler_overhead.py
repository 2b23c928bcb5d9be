"""mixprec.GradScaler against torch.amp.GradScaler, side by side in one run.

1. Training step of the seed MLP (seed 002: 3 x Linear(4096) + ReLU, batch 512, SGD, MSE) under
   torch.autocast, with torch's scaler and with mixprec's (default and ``skip_mode='sync'``):
   ms per iteration, and the host time spent inside ``step()`` + ``update()``. torch's scaler
   reads ``found_inf`` back every step (a sync) unless the optimizer is fused; mixprec's never
   does. Goal on a GPU: mixprec's step+update at least 1.3x faster than torch's.
2. Unscale + finite check of many fp32 gradients (100M elements in 100 tensors on a GPU):
   mixprec's default (torch's fused kernel), mixprec's own foreach composition, and torch's
   scaler. Goal: mixprec's unscale throughput within 10% of torch's.

On a CPU the sizes shrink (``--small`` is implied) so the script finishes in about a minute.

Usage::

    python benchmarks/scaler_overhead.py [--device cuda|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mixprec


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _mlp_rows(device: str, width: int, batch: int, steps: int, rounds: int) -> list[dict]:
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, width),
    ).to(device)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)
    variants = {
        "torch.amp.GradScaler": lambda: torch.amp.GradScaler(device),
        "mixprec.GradScaler": lambda: mixprec.GradScaler(device),
        "mixprec.GradScaler(skip_mode='sync')": lambda: mixprec.GradScaler(
            device, skip_mode="sync"
        ),
    }
    scalers = {name: make() for name, make in variants.items()}

    def block(scaler) -> tuple[float, float]:
        host = 0.0
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            h = time.perf_counter()
            scaler.step(opt)
            scaler.update()
            host += time.perf_counter() - h
        _sync(device)
        return (time.perf_counter() - t0) / steps, host / steps

    for s in scalers.values():
        block(s)
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in scalers}
    for r in range(rounds):
        for n in scalers if r % 2 == 0 else list(scalers)[::-1]:
            got[n].append(block(scalers[n]))
    ref_iter = statistics.median(t for t, _ in got["torch.amp.GradScaler"])
    ref_host = statistics.median(h for _, h in got["torch.amp.GradScaler"])
    rows = []
    for n, vals in got.items():
        it = statistics.median(t for t, _ in vals)
        host = statistics.median(h for _, h in vals)
        rows.append({
            "workload": f"seed MLP {width}x3, batch {batch}", "variant": n,
            "ms_per_iteration": it * 1e3, "step_update_host_ms": host * 1e3,
            "iteration_speedup_vs_torch": ref_iter / it,
            "step_update_speedup_vs_torch": ref_host / host,
        })  # fmt: skip
    return rows


def _unscale_rows(device: str, tensors: int, per_tensor: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(per_tensor, device=device)) for _ in range(tensors)]
    opt = torch.optim.SGD(params, lr=0.0)
    grads = [torch.randn(per_tensor, device=device) for _ in range(tensors)]
    nbytes = tensors * per_tensor * 4 * 2  # read + write

    def run(make) -> float:
        times = []
        for _ in range(rounds):
            scaler = make()
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            scaler.scale(torch.zeros((), device=device, requires_grad=True))  # create its state
            _sync(device)
            t0 = time.perf_counter()
            scaler.unscale_(opt)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    variants = {
        "mixprec unscale_ (fused kernel, default)": lambda: mixprec.GradScaler(device),
        "mixprec unscale_ (foreach)": lambda: mixprec.GradScaler(device, unscale_impl="foreach"),
        "torch.amp.GradScaler unscale_": lambda: torch.amp.GradScaler(device),
    }
    for make in variants.values():
        run(make)
    result = {n: run(make) for n, make in variants.items()}
    ref = result["torch.amp.GradScaler unscale_"]
    return [
        {"workload": f"unscale {tensors} x {per_tensor} fp32", "variant": n,
         "ms": t * 1e3, "GB_per_s": nbytes / t / 1e9, "throughput_vs_torch": ref / t}
        for n, t in result.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"], help="default: cuda if available")  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="timed blocks per scaler in the MLP part (interleaved) and timed unscale_ calls "
        "per variant; the median is reported (default: %(default)s)",
    )
    parser.add_argument("--width", type=int, default=None, help="MLP width (4096 GPU, 512 CPU)")
    parser.add_argument("--batch", type=int, default=None, help="MLP batch (512 GPU, 64 CPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="MLP steps per timed block (20 GPU, 5 CPU)")  # fmt: skip
    parser.add_argument("--tensors", type=int, default=100, help="gradients to unscale (100)")
    parser.add_argument(
        "--per-tensor",
        type=int,
        default=None,
        help="elements per gradient (1,000,000 GPU: 100M in all; 100,000 CPU)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the metadata and the rows of both parts (times, speed-ups against torch's "
        "scaler) as JSON",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was requested but CUDA is not available")
    gpu = args.device == "cuda"
    mlp = _mlp_rows(args.device, args.width or (4096 if gpu else 512),
                    args.batch or (512 if gpu else 64), args.steps or (20 if gpu else 5),
                    args.rounds)  # fmt: skip
    uns = _unscale_rows(
        args.device, args.tensors, args.per_tensor or (1_000_000 if gpu else 100_000), args.rounds
    )
    name = torch.cuda.get_device_name() if gpu else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {name}")
    print(f"\n{mlp[0]['workload']}")
    print(f"  {'variant':40s} {'ms/iter':>8s} {'step+update host ms':>20s} {'speed-up':>9s}")
    for r in mlp:
        print(
            f"  {r['variant']:40s} {r['ms_per_iteration']:8.3f} "
            f"{r['step_update_host_ms']:20.3f} {r['step_update_speedup_vs_torch']:8.2f}x"
        )
    print(f"\n{uns[0]['workload']}")
    print(f"  {'variant':40s} {'ms':>8s} {'GB/s':>8s} {'vs torch':>9s}")
    for r in uns:
        print(f"  {r['variant']:40s} {r['ms']:8.3f} {r['GB_per_s']:8.1f} "
              f"{r['throughput_vs_torch']:8.2f}x")  # fmt: skip
    if args.json:
        meta = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                "python": platform.python_version(), "device": name}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": mlp + uns}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
