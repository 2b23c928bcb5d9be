"""Whole-step capture against eager AMP, torch.compile and a hand-written CUDA graph, in one run.

For each workload (the seed MLP, ResNet-50 on 32x32 images, the GPT-2-small-like decoder), one
row per variant:

  fp32                 eager fp32 (the baseline)
  torch.amp fp16/bf16  torch.autocast (+ torch.amp.GradScaler for fp16), eager
  torch.amp+compile    torch.autocast bf16 with torch.compile(model) (default mode)
  manual fp16/bf16     the expert's route: torch.cuda.graph around zero_grad + autocast forward
                       + loss + backward + torch's GradScaler + a *fused* optimizer (the only
                       way torch's scaler avoids its host sync), static shapes
  O1 eager fp16/bf16   mixprec.initialize O1 + scale_loss, eager
  TrainStep ...        mixprec.TrainStep: O1 fp16 (dynamic scaling), O1 bf16, O2 fp16, all
                       with the manual route's fused optimizer; "O1 fp16 any-opt" with the
                       workload's optimizer unfused (the device-side snapshot-and-restore skip);
                       "O1 bf16+compile" adds torch.compile of the model

Timing: after warm-up, `--steps` steps are launched back to back and the device is synchronised
once; ms/step = elapsed / steps, the median of `--rounds` rounds. This measures throughput, the
figure launch overhead and host syncs spoil. Speed-ups in a row are against fp32, against torch.amp
in the same dtype, and against the manual capture in the same dtype, all from this run.

On a CPU the manual capture and the fp16 rows are skipped (each says why) and TrainStep runs its
eager fallback, at small sizes unless --full.

Usage::

    PYTHONPATH=src python benchmarks/graph_step.py [--workloads mlp,resnet50,gpt2]
        [--variants ...] [--device auto|cpu|cuda] [--full] [--compile-backend inductor]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import mixprec
from mixprec.bench.report import metadata
from mixprec.bench.workloads import WORKLOADS, Workload, WorkloadSize
from mixprec.levels.optimizer import constructor_defaults

VARIANTS = (
    "fp32", "torch.amp fp16", "torch.amp bf16", "torch.amp+compile bf16", "manual fp16",
    "manual bf16", "O1 eager fp16", "O1 eager bf16", "TrainStep O1 fp16", "TrainStep O1 bf16",
    "TrainStep O2 fp16", "TrainStep O1 fp16 any-opt", "TrainStep O1 bf16+compile",
)  # fmt: skip


def _unavailable(name: str, device: str) -> str:
    """Why variant `name` cannot run on `device` ('' if it can)."""
    if device == "cuda":
        return ""
    if "fp16" in name:
        return "fp16 matmuls are ~100x slower than bf16 on CPUs"
    if name.startswith("manual"):
        return "torch.cuda.graph needs a CUDA device"
    return ""


def _dtype(name: str) -> torch.dtype | None:
    if "fp16" in name:
        return torch.float16
    if "bf16" in name:
        return torch.bfloat16
    return None


def _fused_optimizer(workload: Workload, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The workload's optimizer with fused kernels (what the manual capture needs)."""
    base = workload.optimizer(model, "cpu")
    kwargs = constructor_defaults(base)
    kwargs.pop("foreach", None)
    kwargs["fused"] = True
    if "capturable" in kwargs:
        kwargs["capturable"] = True
    return type(base)(model.parameters(), **kwargs)


def _manual_capture(workload, model, batch, device, dtype) -> Callable[[], torch.Tensor]:
    opt = _fused_optimizer(workload, model)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    static = [t.clone() for t in batch]

    def body() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            out = model(static[0])
        loss = workload.loss(out, tuple(static))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = body()

    def step() -> torch.Tensor:
        for dst, src in zip(static, batch, strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_loss

    return step


def build(name: str, workload: Workload, params: dict, device: str,
          compile_backend: str = "inductor") -> Callable[[], torch.Tensor]:  # fmt: skip
    """One training step of `workload` under variant `name`.

    `compile_backend` is torch.compile's backend for the "+compile" variants: inductor (the
    default, what the table measures) or a cheaper one (eager, aot_eager) for smoke runs.
    """
    torch.manual_seed(0)
    model, batch = workload.build(params, device)
    dtype = _dtype(name)
    compute = lambda m, *b: workload.loss(m(b[0]), b)  # noqa: E731
    if name == "fp32":
        opt = workload.optimizer(model, device)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = workload.loss(model(batch[0]), batch)
            loss.backward()
            opt.step()
            return loss.detach()

        return step
    if name.startswith("torch.amp"):
        opt = workload.optimizer(model, device)
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
        run = torch.compile(model, backend=compile_backend) if "compile" in name else model

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                out = run(batch[0])
            loss = workload.loss(out, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        return step
    if name.startswith("manual"):
        return _manual_capture(workload, model, batch, device, dtype)
    if name.startswith("O1 eager"):
        model, opt = mixprec.initialize(model, workload.optimizer(model, device), "O1",
                                        dtype=dtype)  # fmt: skip

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = workload.loss(model(batch[0]), batch)
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return loss.detach()

        return step
    level = "O2" if "O2" in name else "O1"
    if "any-opt" in name:  # the workload's optimizer without fused kernels, as users have it
        opt = workload.optimizer(model, "cpu")
    elif device != "cuda":
        opt = workload.optimizer(model, device)
    else:
        opt = _fused_optimizer(workload, model)
    compiled = {"backend": compile_backend} if "compile" in name else False
    train_step = mixprec.TrainStep(model, opt, compute_loss=compute, opt_level=level,
                                   dtype=dtype, compile=compiled)  # fmt: skip
    step = lambda: train_step(*batch)  # noqa: E731
    step.train_step = train_step  # type: ignore[attr-defined]
    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(step: Callable[[], torch.Tensor], device: str, warmup: int, steps: int,
            rounds: int) -> tuple[float, float | None, float]:  # fmt: skip
    """(median ms/step over rounds of back-to-back steps, peak MiB, final loss)."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device == "cuda":
        # An earlier variant's model and optimizer can sit in a reference cycle (torch's first
        # optimizer construction leaves one) until a collection: free them before the peak.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    per_round = []
    loss = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        _sync(device)
        per_round.append((time.perf_counter() - t0) / steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return statistics.median(per_round) * 1e3, peak, float(loss.item())  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="mlp,resnet50,gpt2",
                    help="comma-separated, from: mlp, resnet50, gpt2 (default: all)")  # fmt: skip
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated, from: " + ", ".join(VARIANTS) + " (default: all)",
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="default: cuda where available, else cpu")  # fmt: skip
    ap.add_argument("--full", action="store_true", help="the seeds' sizes on a CPU too")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default 20 GPU)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds of steps, variants in turns; the median is reported (default: 5)",
    )
    ap.add_argument("--warmup", type=int, default=5,
                    help="untimed steps per variant first (default: 5)")  # fmt: skip
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size instead of the workload's (toy sizes for smoke runs)",
    )
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the +compile variants (default inductor; "
                    "eager or aot_eager make smoke runs fast)")  # fmt: skip
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON records")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; valid: {', '.join(VARIANTS)}")
    rows: list[dict[str, Any]] = []
    for wname in args.workloads.split(","):
        workload = WORKLOADS[wname]
        size = workload.size(args.full, device)
        if args.batch:
            size = WorkloadSize(f"{size.description}; batch set to {args.batch}", size.steps,
                                size.warmup, {**size.params, "batch": args.batch})  # fmt: skip
        steps = args.steps or (20 if device == "cuda" else max(2, size.steps // 4))
        block = []
        for name in names:
            row: dict[str, Any] = {"workload": wname, "size": size.description, "variant": name,
                                   "device": device, "status": "ok", "reason": ""}  # fmt: skip
            if "compile" in name:
                row["compile_backend"] = args.compile_backend
            why = _unavailable(name, device)
            if why:
                row.update(status="skipped", reason=why)
                block.append(row)
                continue
            print(f"{wname:9s} {name} ...", file=sys.stderr, flush=True)
            try:
                step = build(name, workload, size.params, device, args.compile_backend)
                ms, peak, loss = measure(step, device, args.warmup, steps, args.rounds)
            except Exception as err:  # a variant that fails is reported, not fatal
                row.update(status="failed", reason=f"{type(err).__name__}: {err}"[:300])
                block.append(row)
                continue
            ts = getattr(step, "train_step", None)
            row.update(ms_per_step=ms, peak_MiB=peak, final_loss=loss)
            if ts is not None:
                row.update(captured=ts.captured, reason=ts.reason)
            block.append(row)
            del step
            if device == "cuda":
                torch.cuda.empty_cache()
        ok = {r["variant"]: r for r in block if r["status"] == "ok"}
        for r in block:
            if r["status"] != "ok":
                continue
            dt = "bf16" if "bf16" in r["variant"] else "fp16"
            for ref, key in (("fp32", "x_fp32"), (f"torch.amp {dt}", "x_torch_amp"),
                             (f"manual {dt}", "x_manual")):  # fmt: skip
                if ref in ok:
                    r[key] = ok[ref]["ms_per_step"] / r["ms_per_step"]
        rows += block
    meta = metadata(device)
    meta["command"] = "python benchmarks/graph_step.py " + " ".join(sys.argv[1:])
    print(f"{meta['device_name']} | torch {meta['torch']} | mixprec {meta['mixprec']}")
    print("ms/step: back-to-back steps, one sync per round, median of rounds; x: speed-up over "
          "fp32 / torch.amp (same dtype) / manual capture (same dtype)")  # fmt: skip
    for wname in dict.fromkeys(r["workload"] for r in rows):
        print(f"\n{wname}")
        print(f"  {'variant':27s} {'ms/step':>8s} {'x fp32':>7s} {'x amp':>7s} {'x manual':>8s}"
              f" {'peak MiB':>9s}")  # fmt: skip
        for r in (r for r in rows if r["workload"] == wname):
            if r["status"] != "ok":
                print(f"  {r['variant']:27s} {r['status']}: {r['reason']}")
                continue

            def f(key: str, spec: str = ".2f", suffix: str = "x", r: dict = r) -> str:
                v = r.get(key)
                return "-" if v is None else f"{v:{spec}}{suffix}"

            cap = "" if r.get("captured") in (None, True) else "  (eager: see JSON reason)"
            print(f"  {r['variant']:27s} {r['ms_per_step']:8.2f} {f('x_fp32'):>7s} "
                  f"{f('x_torch_amp'):>7s} {f('x_manual'):>8s} {f('peak_MiB', '.0f', ''):>9s}"
                  f"{cap}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**meta, **r} for r in rows], fh, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
