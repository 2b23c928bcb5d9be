"""The whole training step on a CPU: fp32, torch.amp (eager and compiled), mixprec eager and
TrainStep, side by side in one interleaved run.

Rows (each a full step: forward, loss, backward, optimizer, with the dtype's loss scaling):

- ``fp32``: no autocast (the baseline);
- ``torch.amp``: ``torch.autocast`` around the forward (+ ``torch.amp.GradScaler`` for fp16);
- ``torch.amp+compile``: the same with ``torch.compile(model)``, how users compile today;
- ``torch.amp+compile+opt``: and a ``torch.compile``d ``optimizer.step`` (torch's recipe: the lr
  held in a tensor);
- ``O1``, ``O2``: mixprec's opt levels, eager (``initialize`` + ``scale_loss``);
- ``TrainStep O1``, ``TrainStep O2``: mixprec's whole step compiled (`mixprec.TrainStep`).

Workloads: the seed MLP, ResNet-50 at CIFAR size, the GPT-2-like decoder (sizes below, chosen
so that a step takes tens to hundreds of milliseconds on two cores). Every variant is built and
warmed up first (the compile time of the compiled ones is reported on its own), then the
variants take turns for ``--rounds`` rounds, so a burst of load from another process slows all
of them alike; each row reports the median time per step and its ratio to ``torch.amp``'s and
to ``fp32``'s median over the same rounds, and the ratio to ``torch.amp`` round by round (its
spread says how much the machine drifted). A variant's turn in a round is as many steps as
make ``--min-sample-ms`` (estimated from its last warm-up step): a single 4 ms step timed on a
shared 2-core machine is mostly timer and scheduler noise.

``--malloc keep`` runs every row with `mixprec.keep_cpu_memory` (freed memory kept for the next
step); the default, ``system``, leaves the C allocator as it is. Each row reports its minor page
faults per step (the kernel's count, ``getrusage``): fresh pages the step had to fault in.

Also reported: the bf16 and fp32 matmul rates measured at the start (the share of the bf16 rate
a step achieves says how much of the machine a row uses), and, for TrainStep rows, how many
graphs were compiled after warm-up (0 means no recompilation; an LR schedule runs during the
GPT rounds to show it).

Usage::

    python benchmarks/cpu_step.py --json benchmarks/results/cpu_step_cpu.json
    python benchmarks/cpu_step.py --workloads gpt2 --rounds 5 --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.budget import measure_peak
from mixprec.bench.models import GPT, GPTConfig, ResNet50, seed_mlp
from mixprec.bench.report import cpu_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

VARIANTS = ("fp32", "torch.amp", "torch.amp+compile", "torch.amp+compile+opt", "O1", "O2",
            "TrainStep O1", "TrainStep O2")  # fmt: skip


def _workloads(smoke: bool) -> dict[str, Callable[[], tuple[Any, ...]]]:
    """name -> builder of (model, batch, loss(model, *batch), optimizer factory, FLOPs/step)."""

    def mlp():
        width, batch = (256, 32) if smoke else (1024, 128)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        return (seed_mlp(width), (x, y), lambda m, x, y: F.mse_loss(m(x).float(), y),
                lambda p: torch.optim.SGD(p, lr=1e-3), 8 * 2.0 * batch * width**2)  # fmt: skip

    def resnet50():
        batch, width = (2, 16) if smoke else (8, 64)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        flops = 3 * 0.165e9 * (width / 64) ** 2 * batch
        return (ResNet50(10, width=width), (x, y),
                lambda m, x, y: F.cross_entropy(m(x).float(), y),
                lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), flops)  # fmt: skip

    def gpt2():
        cfg = (
            GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
            if smoke
            else GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=256)
        )
        batch = 2 if smoke else 8
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size),
                               generator=torch.Generator().manual_seed(1))  # fmt: skip
        weights = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd
        n = batch * cfg.block_size
        flops = 6.0 * weights * n + 12.0 * cfg.n_layer * n * cfg.block_size * cfg.n_embd
        return (GPT(cfg), (tokens,),
                lambda m, t: F.cross_entropy(m(t).float().flatten(0, 1), t.flatten()),
                lambda p: torch.optim.AdamW(p, lr=3e-4), flops)  # fmt: skip

    return {"mlp": mlp, "resnet50": resnet50, "gpt2": gpt2}


def _build(variant: str, make: Callable[[], tuple[Any, ...]], dtype: torch.dtype):
    """A function running one step of `variant` (returns the loss), and its TrainStep if any."""
    torch.manual_seed(0)
    model, batch, loss_of, make_opt, _ = make()
    fp16 = dtype == torch.float16
    if variant == "fp32":
        opt = make_opt(model.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, *batch)
            loss.backward()
            opt.step()
            return loss

        return step, None
    if variant.startswith("torch.amp"):
        fwd = torch.compile(model) if "compile" in variant else model
        opt = make_opt(model.parameters())
        opt_step = opt.step
        if variant.endswith("+opt"):
            # torch's recipe for a compiled optimizer: a tensor lr, so schedules do not
            # recompile, and the step compiled on its own.
            for group in opt.param_groups:
                group["lr"] = torch.tensor(group["lr"])
            opt_step = torch.compile(opt.step)
        scaler = torch.amp.GradScaler("cpu", enabled=fp16)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(fwd, *batch)
            scaler.scale(loss).backward()
            if fp16:
                scaler.step(opt)
                scaler.update()
            else:
                opt_step()
            return loss

        return step, None
    if variant in ("O1", "O2"):
        model, opt = mixprec.initialize(model, make_opt(model.parameters()), variant, dtype=dtype)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, *batch)
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return loss

        return step, None
    level = variant.split()[-1]
    train_step = mixprec.TrainStep(model, make_opt(model.parameters()), compute_loss=loss_of,
                                   opt_level=level, dtype=dtype)  # fmt: skip
    return (lambda: train_step(*batch)), train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        default="mlp,resnet50,gpt2",
        help="comma-separated: mlp, resnet50, gpt2 (default: all)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated (default: all): {', '.join(VARIANTS)}",
    )
    parser.add_argument("--dtype", default="bf16", help="bf16 or fp16 (default: bf16)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--min-sample-ms", type=float, default=25.0,
                        help="each variant's turn in a round runs whole steps until about this "
                             "long (default: 25; 0: one step)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps per variant before timing (default: 3; TrainStep compiles "
                             "in its first two)")  # fmt: skip
    parser.add_argument("--schedule-steps", type=int, default=100,
                        help="TrainStep steps run under a cosine LR schedule after the timing, "
                             "counting recompilations (default: 100; 0: none)")  # fmt: skip
    parser.add_argument("--malloc", choices=("system", "keep"), default="system",
                        help="system: the C allocator as it is (default); keep: "
                             "mixprec.keep_cpu_memory() first, for every row")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a test of the script)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    known = _workloads(args.smoke)
    workloads = comma_list(parser, "--workloads", args.workloads, list(known))
    variants = comma_list(parser, "--variants", args.variants, VARIANTS)
    if dtype is None:
        parser.error(f"--dtype {args.dtype!r}: unknown; valid: bf16, fp16")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1 (default: 7)")
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    memory = mixprec.keep_cpu_memory() if args.malloc == "keep" else None
    if memory is not None:
        print(memory, flush=True)
    rates = {n: measure_peak("cpu", n, 0.5 if args.smoke else 1.5) for n in ("fp32", name)}
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}: matmul "
          f"fp32 {rates['fp32'].gflops:,.0f} GFLOP/s, {name} {rates[name].gflops:,.0f} GFLOP/s",
          flush=True)  # fmt: skip

    results: list[dict[str, Any]] = []
    for wname in workloads:
        make = known[wname]
        flops = make()[-1]
        steps, compile_s, trainsteps, repeats = {}, {}, {}, {}
        for v in variants:
            start = time.perf_counter()
            step, train_step = _build(v, make, dtype)
            for _ in range(args.warmup):
                last = time.perf_counter()
                step()
            now = time.perf_counter()
            compile_s[v] = now - start
            steps[v], trainsteps[v] = step, train_step
            repeats[v] = max(1, round(args.min_sample_ms / 1e3 / max(now - last, 1e-6)))
            print(f"  {wname}: {v} built and warmed up in {compile_s[v]:.1f} s", flush=True)
        compiled_before = {v: ts.graphs_compiled for v, ts in trainsteps.items() if ts}
        times: dict[str, list[float]] = {v: [] for v in variants}
        faults = dict.fromkeys(variants, 0)
        for _ in range(args.rounds):
            for v in variants:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                for _ in range(repeats[v]):
                    loss = steps[v]()
                loss.item()  # the step is done (on a CPU, it is anyway)
                times[v].append((time.perf_counter() - start) / repeats[v])
                faults[v] += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                              - before) / repeats[v]  # fmt: skip
        ref = {r: statistics.median(times[r]) for r in ("torch.amp", "fp32") if r in times}
        for v in variants:
            ms = statistics.median(times[v]) * 1e3
            ts = trainsteps[v]
            row = {
                "workload": wname, "variant": v, "dtype": name, "ms_per_step": ms,
                "vs_torch_amp": ref["torch.amp"] * 1e3 / ms if "torch.amp" in ref else None,
                "vs_torch_amp_rounds": ([round(a / b, 4) for a, b in
                                         zip(times["torch.amp"], times[v], strict=True)]
                                        if "torch.amp" in times else None),
                "steps_per_sample": repeats[v],
                "vs_fp32": ref["fp32"] * 1e3 / ms if "fp32" in ref else None,
                "build_and_warmup_s": compile_s[v],
                "page_faults_per_step": faults[v] / args.rounds,
                "pct_of_low_matmul_rate": 100 * flops / (ms / 1e3) / rates[name].flops_per_s,
                "graphs_compiled_after_warmup": (ts.graphs_compiled - compiled_before[v]
                                                 if ts else None),
                "compiled": ts.compiled if ts else None,
                "reason": ts.reason if ts else "",
            }  # fmt: skip
            results.append(row)
        for v, ts in trainsteps.items():
            if ts is None or args.schedule_steps <= 0:
                continue
            # An LR schedule fills the tensor lr in place: no graph is compiled again.
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(ts.optimizer, args.schedule_steps)
            before = ts.graphs_compiled
            for _ in range(args.schedule_steps):
                steps[v]()
                sched.step()
            row = next(r for r in results if r["workload"] == wname and r["variant"] == v)
            row["schedule_steps"] = args.schedule_steps
            row["recompiles_under_lr_schedule"] = ts.graphs_compiled - before
            print(f"  {wname}: {v}: {args.schedule_steps} steps under CosineAnnealingLR, "
                  f"{ts.graphs_compiled - before} graphs compiled again; still compiled: "
                  f"{ts.compiled}", flush=True)  # fmt: skip
        _print_table([r for r in results if r["workload"] == wname])
    if args.json:
        meta = {
            "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "rounds": args.rounds,
            "min_sample_ms": args.min_sample_ms,
            "malloc": str(memory) if memory is not None else "system (as the process found it)",
            "matmul_gflops": {n: p.gflops for n, p in rates.items()},
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{rows[0]['workload']} ({rows[0]['dtype']}): median of the interleaved rounds")
    print(f"  {'variant':24s} {'ms/step':>9s} {'vs torch.amp':>13s} {'vs fp32':>8s} "
          f"{'% low rate':>10s} {'warm-up s':>10s} {'recompiles':>10s} {'faults':>7s}")  # fmt: skip
    for r in rows:
        amp = f"{r['vs_torch_amp']:.2f}x" if r["vs_torch_amp"] else "-"
        fp32 = f"{r['vs_fp32']:.2f}x" if r["vs_fp32"] else "-"
        again = "-" if r["graphs_compiled_after_warmup"] is None else (
            str(r["graphs_compiled_after_warmup"]))  # fmt: skip
        print(f"  {r['variant']:24s} {r['ms_per_step']:9.1f} {amp:>13s} {fp32:>8s} "
              f"{r['pct_of_low_matmul_rate']:9.1f}% {r['build_and_warmup_s']:10.1f} "
              f"{again:>10s} {r['page_faults_per_step']:7.0f}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
