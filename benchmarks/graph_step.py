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

Isolation: on CUDA each workload's manual captures run in a fresh process (``--isolate``), and
after a CUDA error the variants left move to a fresh process, so that a crash costs only its own
rows (a row measured so says ``process`` in the JSON). The first H100 run (torch 2.11) lost every
TrainStep row to the manual capture's illegal memory access, and GPT-2's whole table to a segfault.

Usage::

    PYTHONPATH=src python benchmarks/graph_step.py [--workloads mlp,resnet50,gpt2]
        [--variants ...] [--device auto|cpu|cuda] [--full] [--compile-backend inductor]
        [--isolate VARIANTS] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import mixprec
from mixprec.bench.report import metadata
from mixprec.bench.workloads import WORKLOADS, Workload, WorkloadSize
from mixprec.levels.optimizer import constructor_defaults

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

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
        # Autocast's weight cache off, as torch's make_graphed_callables asks of captured
        # regions (the H200 diagnostic replayed with it on as well; the rows were measured off).
        with torch.autocast(device, dtype=dtype, cache_enabled=False):
            out = model(static[0])
        loss = workload.loss(out, tuple(static))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    # Warm-up and capture on one side stream: autograd remembers the stream each gradient
    # accumulator first ran on, and a capture on another stream would wait on that one.
    # (Where it captures made no difference: benchmarks/diag_manual_capture.py on the H200.)
    phase = "warm-up"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        phase = "capture"
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph, stream=side):
            static_loss = body()
        torch.cuda.synchronize()
        phase = "first replay"
        graph.replay()
        torch.cuda.synchronize()
    except Exception as err:  # say which phase failed: a replay fault shows no useful traceback
        raise RuntimeError(f"in its {phase}: {type(err).__name__}: {err}") from err

    def step() -> torch.Tensor:
        for dst, src in zip(static, batch, strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_loss

    # The graph replays on the model's and optimizer's memory but holds no reference to them:
    # without these, they were freed when build() returned (illegal address on replay).
    step.keep = (model, opt, scaler)  # type: ignore[attr-defined]
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
            rounds: int) -> tuple[float, float | None, float | None, float]:  # fmt: skip
    """(median ms/step over rounds of back-to-back steps, peak MiB allocated, peak MiB reserved,
    final loss).

    Allocated is what tensors held: for a captured step, what stays allocated after the capture
    (parameters, gradients, optimizer state, static inputs); the activations live in the graph's
    private pool, freed inside the graph, and are not counted. Reserved counts the pool too (and
    the allocator's cache after this row's own warm-up, emptied before the timed rounds)."""
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
    reserved = torch.cuda.max_memory_reserved() / 2**20 if device == "cuda" else None
    return (statistics.median(per_round) * 1e3, peak, reserved,
            float(loss.item()))  # type: ignore[union-attr]  # fmt: skip


def _context_lost(err: BaseException) -> bool:
    """Whether `err` leaves this process's CUDA context unusable (every later call fails)."""
    return type(err).__name__ == "AcceleratorError" or "CUDA error" in str(err)


def _measure_row(name: str, wname: str, workload: Workload, size: WorkloadSize, steps: int,
                 device: str, args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One variant's row, measured in this process."""
    row: dict[str, Any] = {"workload": wname, "size": size.description, "variant": name,
                           "device": device, "status": "ok", "reason": ""}  # fmt: skip
    if "compile" in name:
        row["compile_backend"] = args.compile_backend
    why = _unavailable(name, device)
    if why:
        return {**row, "status": "skipped", "reason": why}
    print(f"{wname:9s} {name} ...", file=sys.stderr, flush=True)
    # What this process already holds before the row (earlier rows' library workspaces, which
    # CUDA keeps per stream): part of the row's peak, not of its step.
    held = torch.cuda.memory_allocated() / 2**20 if device == "cuda" else None
    try:
        step = build(name, workload, size.params, device, args.compile_backend)
        ms, peak, reserved, loss = measure(step, device, args.warmup, steps, args.rounds)
    except Exception as err:  # a variant that fails is reported, not fatal
        reason = f"{type(err).__name__}: {err}"[:300]
        return {**row, "status": "failed", "reason": reason, "context_lost": _context_lost(err)}
    ts = getattr(step, "train_step", None)
    row.update(ms_per_step=ms, peak_MiB=peak, reserved_MiB=reserved, held_before_MiB=held,
               final_loss=loss)  # fmt: skip
    if ts is not None:
        row.update(captured=ts.captured, reason=ts.reason)
    del step
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def _in_fresh_process(args: argparse.Namespace, device: str, wname: str, variants: list[str],
                      why: str) -> list[dict[str, Any]]:  # fmt: skip
    """`variants` of `wname` measured by this script in a new Python process.

    Costs a process start (torch and mixprec imported again, a new CUDA context: seconds). It
    keeps a crash out of this process: the first H100 run lost every row after a hand-written
    capture's illegal memory access (the context is unusable after one), and a whole workload
    to a segfault.
    """
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--workloads", wname, "--variants",
           ",".join(variants), "--device", device, "--warmup", str(args.warmup), "--rounds",
           str(args.rounds), "--compile-backend", args.compile_backend, "--isolate", "",
           "--no-table", "--json", path]  # fmt: skip
    cmd += ["--full"] if args.full else []
    cmd += ["--steps", str(args.steps)] if args.steps else []
    cmd += ["--batch", str(args.batch)] if args.batch else []
    proc = subprocess.run(cmd, check=False)
    try:
        with open(path) as fh:
            got = {r["variant"]: r for r in json.load(fh)}
    except (OSError, ValueError):
        got = {}
    finally:
        os.unlink(path)
    keep = ("workload", "size", "variant", "device", "status", "reason", "compile_backend",
            "ms_per_step", "peak_MiB", "reserved_MiB", "held_before_MiB", "final_loss",
            "captured", "x_fp32",
            "x_torch_amp",
            "x_manual", "process")  # fmt: skip
    rc = proc.returncode
    ended = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
    rows = []
    for name in variants:
        r = got.get(name)
        if r is None:
            r = {"workload": wname, "variant": name, "device": device, "status": "failed",
                 "reason": f"its fresh process ({why}) {ended} before measuring it"}  # fmt: skip
        rows.append({k: r[k] for k in keep if k in r} | {"process": r.get("process") or
                                                         f"fresh ({why})"})  # fmt: skip
    return rows


def _isolated_variants(args: argparse.Namespace, device: str,
                       ap: argparse.ArgumentParser) -> set[str]:  # fmt: skip
    if args.isolate is None:
        return {v for v in VARIANTS if v.startswith("manual")} if device == "cuda" else set()
    return set(comma_list(ap, "--isolate", args.isolate, VARIANTS, none="none"))


def _print_table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"{meta['device_name']} | torch {meta['torch']} | mixprec {meta['mixprec']}")
    print("ms/step: back-to-back steps, one sync per round, median of rounds; x: speed-up over "
          "fp32 / torch.amp (same dtype) / manual capture (same dtype)")  # fmt: skip
    for wname in dict.fromkeys(r["workload"] for r in rows):
        print(f"\n{wname}")
        print(f"  {'variant':27s} {'ms/step':>8s} {'x fp32':>7s} {'x amp':>7s} {'x manual':>8s}"
              f" {'peak MiB':>9s} {'reserved':>9s}")  # fmt: skip
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
                  f" {f('reserved_MiB', '.0f', ''):>9s}{cap}")  # fmt: skip


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
    ap.add_argument(
        "--isolate",
        default=None,
        metavar="VARIANTS",
        help="comma-separated variants each measured in a fresh process, so that a crash "
        "loses only its own row (default on CUDA: the manual captures; '' for none). After "
        "a CUDA error the rest of the run moves to a fresh process anyway",
    )
    ap.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON records")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    workloads = comma_list(ap, "--workloads", args.workloads, list(WORKLOADS))
    names = comma_list(ap, "--variants", args.variants, VARIANTS)
    isolate = _isolated_variants(args, device, ap)
    lost = False  # this process's CUDA context is unusable: measure the rest elsewhere
    rows: list[dict[str, Any]] = []
    for wname in workloads:
        workload = WORKLOADS[wname]
        size = workload.size(args.full, device)
        if args.batch:
            size = WorkloadSize(f"{size.description}; batch set to {args.batch}", size.steps,
                                size.warmup, {**size.params, "batch": args.batch})  # fmt: skip
        steps = args.steps or (20 if device == "cuda" else max(2, size.steps // 4))
        block: list[dict[str, Any]] = []
        pending = list(names)
        while pending:
            name = pending.pop(0)
            if lost or name in isolate:
                # A fresh process: every variant left once this one's CUDA context is lost,
                # else this one (with the other isolated variants next to it).
                group = [name, *pending] if lost else [name]
                while not lost and pending and pending[0] in isolate:
                    group.append(pending.pop(0))
                pending = pending if not lost else []
                why = "after a CUDA error in the parent" if lost else "--isolate"
                block += _in_fresh_process(args, device, wname, group, why)
                continue
            row = _measure_row(name, wname, workload, size, steps, device, args)
            lost = lost or bool(row.pop("context_lost", False))
            block.append(row)
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
    if not args.no_table:
        _print_table(meta, rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**meta, **r} for r in rows], fh, indent=1)
        if not args.no_table:
            print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
