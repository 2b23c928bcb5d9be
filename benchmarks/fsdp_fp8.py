"""FSDP2 + FP8 on CPU processes over gloo: bytes all-gathered, memory per rank, losses against
one process, and the step time, FP8 against the same model gathered in bf16.

The model: an input projection, `--depth` residual MLP blocks (d -> 4d -> d, each block an
FSDP2 unit) and an output head; ``fp8=tensorwise`` with the default rule puts every block's
two linear layers in FP8 (not the first and last layer). Each of `--nproc` ranks trains on its
slice of a global batch at O2 (bf16 compute, fp32 shards as masters):

- ``bf16``: ``mixprec.fully_shard(model, opt_level='O2')``: weights all-gathered in bf16;
- ``fp8``: ``mixprec.fully_shard(model, opt_level='O2', fp8=...)``: FP8 weights all-gathered
  in FP8 with their scale;
- on rank 0, the one-process reference: the same FP8 model trained on every rank's slice as
  micro-batches of one step (the losses must be equal).

All-gather bytes are counted from the collectives (a dispatch mode over c10d's all-gathers).
Memory per rank: the persistent state (`mixprec.distributed.memory.rank_bytes`: parameters,
gradients, optimizer state) and the transient unsharded weights of one block (the all-gather's
output). Step time: the two models step alternately, `--steps` times, median ms per step.

Usage::

    python benchmarks/fsdp_fp8.py [--nproc 2] [--width 256] [--depth 4] [--steps 12]
        [--recipe tensorwise] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec.bench.report import metadata
from mixprec.distributed.memory import rank_bytes
from mixprec.fp8 import RECIPES, gemm

ROWS, IN, OUT = 16, 64, 16


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, width), *[Block(width) for _ in range(depth)],
                         nn.Linear(width, OUT))  # fmt: skip


class CountAllGathers(TorchDispatchMode):
    """Bytes each c10d all-gather takes from this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "allgather" in name.replace("_", "") and name.startswith(("c10d", "_c10d")):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors:
                self.sizes.append(min(t.numel() * t.element_size() for t in tensors))
        return func(*args, **(kwargs or {}))


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * world, IN, generator=g), torch.randn(ROWS * world, OUT, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                           timeout=datetime.timedelta(seconds=300))  # fmt: skip
    gemm.set_gemm_path("emulate")  # the same kernels on every rank and in the reference
    runs: dict[str, Any] = {}
    for name, fp8 in (("bf16", None), ("fp8", args.recipe)):
        model = build(args.width, args.depth)
        kw = {"fp8": fp8} if fp8 else {}
        mixprec.fully_shard(model, opt_level="O2", units=(Block,), **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = mixprec.initialize(model, opt, "O2")
        runs[name] = {"model": model, "opt": opt, "ms": [], "losses": []}
    out: dict[str, Any] = {}
    for step in range(args.steps):
        x, y = _data(step, world)
        xr, yr = x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]
        for name, run in runs.items():
            counter = CountAllGathers()
            dist.barrier()
            start = time.perf_counter()
            with counter:
                run["opt"].zero_grad()
                loss = _loss(run["model"], xr, yr)
                with mixprec.scale_loss(loss, run["opt"]) as scaled:
                    scaled.backward()
            if step == 1:
                out[f"{name} memory"] = rank_bytes(run["model"], run["opt"])
                out[f"{name} gathers"] = counter.sizes
            run["opt"].step()
            run["ms"].append((time.perf_counter() - start) * 1e3)
            every = [torch.zeros_like(loss) for _ in range(world)]
            dist.all_gather(every, loss.detach())
            run["losses"].append(torch.stack(every).tolist())
    for name, run in runs.items():
        out[f"{name} ms"] = statistics.median(run["ms"][2:])
        out[f"{name} losses"] = run["losses"]
    if rank == 0:
        out["reference losses"] = _reference(args, world)
    dist.barrier()
    runs.clear()
    dist.destroy_process_group()
    queue.put((rank, out))


def _reference(args: argparse.Namespace, world: int) -> list[list[float]]:
    model = build(args.width, args.depth)
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2",
                                    fp8=args.recipe)  # fmt: skip
    losses = []
    for step in range(args.steps):
        x, y = _data(step, world)
        opt.zero_grad()
        mine = []
        for r in range(world):
            loss = _loss(model, x[r * ROWS : (r + 1) * ROWS], y[r * ROWS : (r + 1) * ROWS])
            with mixprec.scale_loss(loss / world, opt) as scaled:
                scaled.backward()
            mine.append(loss.item())
        opt.step()
        losses.append(mine)
    return losses


def summarize(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    r0 = ranks[0]
    fp8, bf16 = r0["fp8 gathers"], r0["bf16 gathers"]
    units = args.depth + 1  # the blocks, and the root (input projection and head)
    # Forward: root, blocks 0..depth-1; backward: blocks reversed, then the root (if resharded;
    # FSDP2 keeps the root unsharded after forward).
    block_fp8 = [f for f, b in zip(fp8, bf16, strict=True) if f != b]
    block_bf16 = [b for f, b in zip(fp8, bf16, strict=True) if f != b]
    flat_ref = [v for step in r0["reference losses"] for v in step]
    flat_fp8 = [v for step in r0["fp8 losses"] for v in step]
    # A recipe whose weights are gathered in bf16 (rowwise: its backward re-quantises the
    # weight along the other axis) has no FP8 gathers: those rows say so, not a ZeroDivision.
    none = "no FP8 all-gather: this recipe's weights are gathered in bf16"
    return {
        "all-gathers per step": len(fp8),
        "units": units,
        "bytes per step, fp8 / bf16 (all units)": sum(fp8) / sum(bf16),
        "bytes per step, fp8 / bf16 (FP8 blocks)": (
            sum(block_fp8) / sum(block_bf16) if block_fp8 else none),
        "unsharded weights of one block, bytes (fp8, bf16)": [
            max(block_fp8) * args.nproc, max(block_bf16) * args.nproc] if block_fp8 else none,
        "persistent bytes per rank (fp8, bf16)": [r0["fp8 memory"]["total"],
                                                  r0["bf16 memory"]["total"]],
        "max |loss - one process| (fp8)": max(abs(a - b) for a, b in zip(flat_fp8, flat_ref,
                                                                         strict=True)),
        "step ms (fp8, bf16)": [r0["fp8 ms"], r0["bf16 ms"]],
        "step time fp8 / bf16": r0["fp8 ms"] / r0["bf16 ms"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help=f"CPU processes (gloo ranks, one torch thread each), each training on {ROWS} rows "
        "of the global batch (default: %(default)s)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=256,
        help="d of the residual blocks (d -> 4d -> d) (default: %(default)s; 32 with --smoke)",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=4,
        help="residual MLP blocks, each an FSDP2 unit (default: %(default)s; 2 with --smoke)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=12,
        help="training steps of each model, at least 3; the step time is the median of all but "
        "the first 2 (default: %(default)s; 4 with --smoke)",
    )
    parser.add_argument(
        "--recipe",
        default="tensorwise",
        type=str.lower,
        choices=list(RECIPES),
        help=f"FP8 recipe of the fp8 model and the reference, one of: {', '.join(RECIPES)}; "
        "rowwise weights are not all-gathered in FP8 (default: %(default)s)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the run's metadata, the summary, each rank's memory and rank 0's "
        "measurements (all-gather sizes, step times, losses) as JSON",
    )
    parser.add_argument("--smoke", action="store_true", help="width 32, depth 2, 4 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.depth, args.steps = 32, 2, 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.nproc, port, args, queue))
             for r in range(args.nproc)]  # fmt: skip
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    ranks = [results[r] for r in range(args.nproc)]
    doc = {"meta": {**metadata("cpu"), "nproc": args.nproc, "torch_threads_per_rank": 1,
                    "width": args.width, "depth": args.depth, "recipe": args.recipe,
                    "command": " ".join(["python", "benchmarks/fsdp_fp8.py", *sys.argv[1:]])},
           "summary": summarize(ranks, args),
           "per_rank_memory": [{k: r[k] for k in ("fp8 memory", "bf16 memory")} for r in ranks],
           "rank0": {k: v for k, v in ranks[0].items() if not k.endswith("memory")}}  # fmt: skip
    print(json.dumps(doc["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
