"""Data-parallel runs of mixprec's commands: torchrun launches, the process group comes from it.

``mixprec train --nproc-per-node 4`` is ``torchrun --standalone --nproc-per-node 4 -m mixprec
train`` (the same arguments, without the flag): `launch` builds that command line and hands it
to ``torch.distributed.run``, PyTorch's own launcher, in this process. Each worker then runs the
command with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and `init_from_env` opens the process group from it: NCCL and one GPU per
process (``cuda:LOCAL_RANK``) on CUDA, gloo on the CPU. Launching with torchrun directly (several
nodes, a rendezvous server) works the same way: the commands only read the environment.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mixprec.distributed.topology import DistributedError, is_initialized

__all__ = [
    "DistContext",
    "in_worker",
    "init_from_env",
    "joined",
    "launch",
    "torchrun_command",
]


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a data-parallel run (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # "cpu" or "cuda:LOCAL_RANK"
    backend: str | None = None  # None when not distributed
    owns_group: bool = False  # whether init_from_env created the process group

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes results."""
        return self.rank == 0

    def ddp_kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``DistributedDataParallel`` on this process's device."""
        return {"device_ids": [self.local_rank]} if self.device.startswith("cuda") else {}

    def close(self, wait: bool = True) -> None:
        """Destroy the process group if `init_from_env` created it.

        `wait`: a barrier first, so every rank leaves together and none tears its connections
        down under another. Not after an error: the other ranks may never reach the barrier
        (torchrun stops them when this process exits).
        """
        if self.owns_group and is_initialized():
            if wait:
                torch.distributed.barrier()
            # DDP objects in reference cycles go while the group exists: a Reducer freed at
            # interpreter exit, after the group, can abort the process
            gc.collect()
            torch.distributed.destroy_process_group()


def in_worker() -> bool:
    """Whether this process was started by torchrun (its environment is set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def init_from_env(device: str) -> DistContext:
    """Join the run torchrun set up for this process (a no-op outside torchrun, or at world 1).

    Args:
        device: ``'cpu'`` or ``'cuda'``; selects the backend (gloo or NCCL) and, on CUDA, this
            process's GPU (``LOCAL_RANK``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not in_worker():
        return DistContext(device=device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise DistributedError(
                f"LOCAL_RANK {local} has no GPU: this node has {torch.cuda.device_count()}. Use "
                f"--nproc-per-node {torch.cuda.device_count()} or fewer, or --device cpu."
            )
        torch.cuda.set_device(local)
        backend, where = "nccl", f"cuda:{local}"
    else:
        backend, where = "gloo", "cpu"
    owns = not is_initialized()
    if owns:
        torch.distributed.init_process_group(backend)
    return DistContext(rank, world, local, where, backend, owns)


@contextlib.contextmanager
def joined(device: str) -> Iterator[DistContext]:
    """`init_from_env` for a block; the group is closed after it (without a barrier on error)."""
    ctx = init_from_env(device)
    try:
        yield ctx
    except BaseException:
        ctx.close(wait=False)
        raise
    ctx.close()


def torchrun_command(nproc_per_node: int, argv: Sequence[str]) -> list[str]:
    """torchrun's arguments that run ``mixprec <argv>`` in `nproc_per_node` local processes."""
    return ["--standalone", f"--nproc-per-node={nproc_per_node}", "-m", "mixprec", *argv]


def launch(nproc_per_node: int, argv: Sequence[str]) -> int:
    """Run ``mixprec <argv>`` under torchrun in `nproc_per_node` processes; their exit status.

    Blocks until every worker has finished. torchrun prints each worker's output (and the
    traceback of a failed one).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_command(nproc_per_node, argv))
    try:
        run(args)
    except ChildFailedError as err:
        codes = [f.exitcode for f in err.failures.values()]
        return next((c for c in codes if c), 1)
    return 0
