"""Memory per rank under FSDP2: plain fp32, FSDP2's MixedPrecisionPolicy, and mixprec O2.

The claim under test: mixprec O2 on FSDP2 (`mixprec.fully_shard`) keeps no fp32 copy beyond
FSDP2's own, because FSDP's fp32 shards are the master weights. Per rank, after one training
step (gradients still held), the bytes of parameters, master weights, gradients, optimizer state
and the scaler's skip snapshot (`mixprec.distributed.memory.rank_bytes`), side by side for:

  fsdp2 fp32          torch's fully_shard, no policy
  fsdp2 mp            torch's fully_shard with MixedPrecisionPolicy(low, reduce fp32) on every unit
  mixprec O2          mixprec.fully_shard(opt_level="O2") + mixprec.initialize (bf16: no scaler)
  mixprec O2 fp16     the same in fp16 with the dynamic loss scaler, fused AdamW (skips in-kernel)
  mixprec O2 fp16 restore   ... with a non-fused AdamW: the snapshot-and-restore skip's extra copy
  unsharded O2        mixprec.initialize O2 without sharding (DDP's layout): low weights + masters

On CUDA each row also has the peak allocated memory of the step (activations and gathered
parameters included). The model: `--depth` blocks of LayerNorm + Linear(w, 4w) + GELU +
Linear(4w, w), each block an FSDP2 unit.

Usage (CPU, 2 gloo ranks spawned here; or under torchrun, which sets the ranks)::

    PYTHONPATH=src python benchmarks/fsdp_memory.py [--nproc 2] [--width 256] [--depth 4]
        [--device cpu|cuda] [--start-method forkserver|fork] [--json PATH]

On a GPU machine: ``--device cuda --nproc <GPUs>`` (one GPU is enough: ``--nproc 1``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.distributed.memory import CATEGORIES, rank_bytes

CONFIGS = (
    "fsdp2 fp32", "fsdp2 mp", "mixprec O2", "mixprec O2 fp16", "mixprec O2 fp16 restore",
    "unsharded O2",
)  # fmt: skip


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)), nn.LayerNorm(width),
                         nn.Linear(width, width))  # fmt: skip


def _setup(config: str, width: int, depth: int, device: str, dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(width, depth).to(device)
    low = torch.float16 if "fp16" in config else dtype
    if config.startswith("fsdp2"):
        policy = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
                  if config == "fsdp2 mp" else MixedPrecisionPolicy())  # fmt: skip
        for block in model[:depth]:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if config == "unsharded O2":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return mixprec.initialize(model, opt, "O2", dtype=low)
    mixprec.fully_shard(model, opt_level="O2", dtype=low, units=(Block,))
    fused = config == "mixprec O2 fp16"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    scaling = {"loss_scale": "dynamic"} if "fp16" in config else {}
    return mixprec.initialize(model, opt, "O2", dtype=low, **scaling)


def _step(model: nn.Module, opt: Any, x: torch.Tensor) -> None:
    from mixprec.levels.optimizer import AmpOptimizer

    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    if isinstance(opt, AmpOptimizer):
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        loss.backward()
    opt.step()


def measure(width: int, depth: int, batch: int, device: str,
            dtype: torch.dtype) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per config: this rank's bytes by category (after two steps), and the CUDA peak."""
    out: dict[str, dict[str, Any]] = {}
    x = torch.randn(batch, width, device=device)
    for config in CONFIGS:
        model, opt = _setup(config, width, depth, device, dtype)
        if device == "cuda":
            gc.collect()  # the previous configuration's objects, if a cycle still holds them
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(2):  # the second step runs with the optimizer state and snapshots in place
            _step(model, opt, x)
        row: dict[str, Any] = rank_bytes(model, opt)
        row["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        out[config] = row
        del model, opt
    return out


def _table(rows: dict[str, dict[str, Any]], world: int, width: int, depth: int) -> str:
    n_params = sum(p.numel() for p in build(width, depth).parameters())
    head = (f"per-rank memory, {world} rank(s), {n_params / 1e6:.2f}M parameters "
            f"(width {width}, depth {depth}), MiB after a step")  # fmt: skip
    cols = [*CATEGORIES, "total", "peak_MiB"]
    lines = [head, f"{'config':26s}" + "".join(f"{c:>14s}" for c in cols)]
    for name, row in rows.items():
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append("-" if v is None else f"{v if c == 'peak_MiB' else v / 2**20:.3f}")
        lines.append(f"{name:26s}" + "".join(f"{c:>14s}" for c in cells))
    return "\n".join(lines)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    _run(args)


def _run(args: argparse.Namespace) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        dtype = torch.bfloat16
        rows = measure(args.width, args.depth, args.batch, device, dtype)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            print(_table(rows, world, args.width, args.depth))
            o2, mp = rows["mixprec O2"], rows["fsdp2 mp"]
            extra = o2["total"] - mp["total"]
            print(f"\nmixprec O2 minus FSDP2's own mixed precision: {extra / 2**20:+.3f} MiB "
                  f"(masters: {o2['masters']} bytes)")  # fmt: skip
            if args.json:
                meta = {"torch": torch.__version__, "mixprec": mixprec.__version__,
                        "device": device, "world_size": world, "width": args.width,
                        "depth": args.depth, "batch": args.batch,
                        "command": " ".join(sys.argv)}  # fmt: skip
                records = [{**meta, "rank": r, "config": c, **row}
                           for r, per in enumerate(gathered) for c, row in per.items()]  # fmt: skip
                with open(args.json, "w") as fh:
                    json.dump(records, fh, indent=1)
                print(f"wrote {args.json}")
        dist.barrier()  # every rank leaves together: none tears its group down under another
    finally:
        gc.collect()  # wrappers in reference cycles go while the group exists, not at exit
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
    from suite.args import check_start_method, start_method_option

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default: 2)")
    parser.add_argument(
        "--width",
        type=int,
        default=256,
        help="w of each block: LayerNorm + Linear(w, 4w) + GELU + Linear(4w, w) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--depth", type=int, default=4, help="blocks, each an FSDP2 unit (default: %(default)s)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=8,
        help="rows of the input batch each rank takes its two steps on, per configuration "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (gloo ranks) or cuda (NCCL, one GPU per rank; adds each step's peak "
        "allocated memory) (default: %(default)s)",
    )
    start_method_option(parser)
    parser.add_argument("--json", metavar="PATH", help="write one record per rank and config")
    args = parser.parse_args(argv)
    check_start_method(parser, args)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _run(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The ranks fork from one server process that imported this script (torch and mixprec with
    # it) once: spawn started each rank as a fresh interpreter that imported them again. The
    # server makes no CUDA context, so each rank starts as clean as a spawned one.
    torch.multiprocessing.start_processes(_worker, args=(args.nproc, port, args),
                                          nprocs=args.nproc,
                                          start_method=args.start_method)  # fmt: skip


if __name__ == "__main__":
    main()
