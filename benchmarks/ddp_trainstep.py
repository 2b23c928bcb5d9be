"""TrainStep under DDP on CUDA: the step, DDP's all-reduce included, captured as one CUDA graph.

Checks (on every rank) and times, for O1 fp16 (dynamic scaling) and O2 fp16:

- capture happens: after the 11 eager DDP iterations PyTorch's rules ask for, the step replays
  a graph (``step.captured``), constructed on TrainStep's side stream with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` set before ``init_process_group`` (this script sets it);
- the numbers are those of the same TrainStep run eagerly (``capture='eager'``) from the same
  initial weights and data, within the tolerance tests/test_trainstep_cuda.py uses (capture
  holds the fused optimizer's lr as a device tensor: last-bit differences), and the loss scales
  are equal step for step;
- an inf in one rank's batch makes every rank skip that step (the scale halves everywhere), in
  the graph as in the eager run, and the ranks' parameters stay equal;
- ms/step of the eager and the captured step (median over `--steps`, after warm-up).

Exit status 1 if any check fails (the message says which), so a test suite can run it.

``--device cpu`` runs the same at toy sizes over gloo (2 ranks by default), in bf16 with the
dynamic scaler: nothing is captured there (the reason says why), the two runs must then agree
bit for bit, and the skip and equal ranks are checked as on the GPU (the GPU suite's smoke mode).

Usage (spawns one process per GPU; ``--nproc 1`` is enough, a world of one still runs NCCL)::

    PYTHONPATH=src python benchmarks/ddp_trainstep.py [--nproc N] [--steps 40] [--width 1024]
        [--device cuda|cpu] [--start-method forkserver|fork] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec

INF_STEP = 15  # after the warm-up: the skip happens inside a replayed graph


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))  # fmt: skip


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float(), y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _run(level: str, capture: str, args: argparse.Namespace, rank: int, world: int) -> dict:
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = _model(args.width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda)
    # fp16 on the GPU (dynamic scaling by default); bf16 with the scaler forced on, on a CPU.
    precision = {"dtype": torch.float16} if cuda else {"dtype": torch.bfloat16,
                                                        "loss_scale": "dynamic"}  # fmt: skip
    step = mixprec.TrainStep(model, opt, compute_loss=_loss, opt_level=level, capture=capture,
                             ddp={"device_ids": [device.index]} if cuda else True,
                             **precision)  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    batches = []
    for i in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g)
        if i == INF_STEP and rank == world - 1:
            x[0, 0] = float("inf")
        batches.append((x.to(device), torch.randint(0, 10, (args.batch,), generator=g).to(device)))
    losses, times, captured, scales = [], [], [], []
    for x, y in batches:
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(x, y))
        _sync(device)
        times.append(time.perf_counter() - t0)
        captured.append(step.captured)
        scales.append(step.scaler.scale_tensor.clone() if step.scaler is not None else None)
    params = [p.detach().float().cpu() for p in mixprec.master_params(step.optimizer)]
    replayed = [t for t, c in zip(times, captured, strict=True) if c]
    warm = replayed or times[len(times) // 2 :]  # replays; or the eager steps after warm-up
    return {
        "losses": torch.stack(losses).float().cpu(),
        "params": params,
        "captured": captured,
        "scales": [float(s) for s in scales if s is not None],
        "ms_per_step": 1e3 * statistics.median(warm),
        "reason": step.reason,
        "explain": step.explain(),
    }


def _checks(level: str, graph: dict, eager: dict, world: int, device: str) -> list[str]:
    failed = []
    if device == "cpu":
        if any(graph["captured"]) or not all(torch.equal(a, b) for a, b in zip(
            graph["params"], eager["params"], strict=True
        )):  # fmt: skip
            failed.append(f"{level}: on a CPU both runs are eager and must agree bit for bit")
    elif not any(graph["captured"]):
        failed.append(f"{level}: never captured ({graph['reason']})")
    elif graph["captured"].index(True) < 11:
        failed.append(f"{level}: captured before 11 eager DDP iterations")
    finite = torch.isfinite(eager["losses"])
    if not (torch.equal(finite, torch.isfinite(graph["losses"])) and torch.allclose(
        graph["losses"][finite], eager["losses"][finite], rtol=1e-3, atol=1e-4
    )):  # fmt: skip
        failed.append(f"{level}: captured losses differ from eager ones")
    if not all(torch.allclose(a, b, rtol=2e-3, atol=2e-4)
               for a, b in zip(graph["params"], eager["params"], strict=True)):  # fmt: skip
        failed.append(f"{level}: captured parameters differ from eager ones")
    if graph["scales"] != eager["scales"]:
        failed.append(f"{level}: captured loss scales differ from eager ones")
    s = graph["scales"]
    if len(s) > INF_STEP and s[INF_STEP] != s[INF_STEP - 1] / 2:
        failed.append(f"{level}: the inf at step {INF_STEP} on rank {world - 1} was not skipped")
    flat = torch.cat([p.flatten() for p in graph["params"]]).to(device)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(gathered[0], t) for t in gathered):
        failed.append(f"{level}: ranks' parameters differ")
    return failed


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    # PyTorch's rule 1 for capturing DDP: async error handling off before the group exists.
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))  # fmt: skip
    records, failed = [], []
    try:
        for level in ("O1", "O2"):
            graph = _run(level, "auto", args, rank, world)
            eager = _run(level, "eager", args, rank, world)
            failed += _checks(level, graph, eager, world, args.device)
            records.append({
                "level": level, "dtype": "fp16" if args.device == "cuda" else "bf16",
                "device": args.device, "rank": rank, "world_size": world,
                "eager_ms": eager["ms_per_step"], "captured_ms": graph["ms_per_step"],
                "speedup": eager["ms_per_step"] / graph["ms_per_step"],
                "first_captured_call": (graph["captured"].index(True) + 1
                                        if any(graph["captured"]) else None),
                "agrees_with_eager": not any(f.startswith(level) for f in failed),
                "max_param_diff": max((a - b).abs().max().item() for a, b in
                                      zip(graph["params"], eager["params"], strict=True)),
                "reason": graph["reason"],
            })  # fmt: skip
        all_records: list[Any] = [None] * world
        dist.all_gather_object(all_records, (records, failed))
        if rank == 0:
            _report([r for rs, _ in all_records for r in rs],
                    sorted({f for _, fs in all_records for f in fs}), args)  # fmt: skip
        dist.barrier()  # every rank leaves together: none tears its group down under another
    finally:
        # DDP objects in reference cycles must go while the group exists: a Reducer freed at exit,
        # after destroy_process_group, can abort the process (a joinable thread in teardown)
        gc.collect()
        dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


def _device_name(device: str) -> str:
    if device == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return f"{torch.cuda.get_device_name()}, NCCL {nccl}"
    from mixprec.bench.report import cpu_name

    return f"{cpu_name()}, gloo"


def _report(records: list[dict], failed: list[str], args: argparse.Namespace) -> None:
    print(f"TrainStep under DDP, {_device_name(args.device)}, torch {torch.__version__}")
    print(f"{'level':6s} {'rank':>4s} {'eager ms':>9s} {'graph ms':>9s} {'speedup':>8s} "
          f"{'captured at':>12s}  agrees (max |dparam|)")  # fmt: skip
    for r in records:
        print(f"{r['level']:6s} {r['rank']:4d} {r['eager_ms']:9.3f} {r['captured_ms']:9.3f} "
              f"{r['speedup']:7.2f}x {r['first_captured_call']!s:>12s}  "
              f"{r['agrees_with_eager']} ({r['max_param_diff']:.2e})")  # fmt: skip
    print("checks: " + ("all passed" if not failed else "; ".join(failed)))
    if args.json:
        meta = {"torch": torch.__version__, "mixprec": mixprec.__version__,
                "device_name": _device_name(args.device), "command": " ".join(sys.argv),
                "width": args.width, "batch": args.batch, "steps": args.steps,
                "failed": failed}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump([{**meta, **r} for r in records], fh, indent=1)
        print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
    from suite.args import check_start_method, start_method_option

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks (default: every GPU; 2 with --device cpu)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=40,
        help=f"training steps of each run (O1 and O2, captured and eager), at least "
        f"{INF_STEP + 3}: the last rank's batch of step {INF_STEP} (from 0) holds an inf; "
        "ms/step is the median after warm-up (default: %(default)s)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=1024,
        help="features of the input and of the MLP's hidden layers; 10 classes out "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--batch", type=int, default=64, help="samples per rank per step (default: %(default)s)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (NCCL, captured; the default with a GPU) or cpu (gloo, "
                        "eager, toy sizes)")  # fmt: skip
    start_method_option(parser)
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write one record per level and rank (ms/step eager and captured, first captured "
        "call, agreement, failed checks) as a JSON list",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; use --device cpu for the eager gloo run")
    check_start_method(parser, args)
    if args.steps <= INF_STEP + 2:
        parser.error(f"--steps must be > {INF_STEP + 2} (the inf is injected at {INF_STEP})")
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The ranks fork from one server process that imported this script (torch and mixprec with
    # it) once: spawn started each rank as a fresh interpreter that imported them again. The
    # server makes no CUDA context, so each rank starts as clean as a spawned one.
    torch.multiprocessing.start_processes(_worker, args=(nproc, port, args), nprocs=nproc,
                                          start_method=args.start_method)  # fmt: skip


if __name__ == "__main__":
    main()
