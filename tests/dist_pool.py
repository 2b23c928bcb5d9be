"""A pool of spawned CPU processes in one gloo process group, reused by many tests.

Starting a process that imports torch and joins a group costs seconds; running each scenario in
fresh processes would make the distributed tests minutes long. A pool starts `world` processes
once (forked from the test process's forkserver, `tests.fork_server`, which imported torch,
mixprec and the scenario modules once), joins them in a gloo group, and runs
scenario functions on every rank: ``pool.run(fn, *args)`` calls ``fn(rank, world, *args)`` in
each process and returns the per-rank results, or raises with the failing ranks' tracebacks.
Scenario functions must live in an importable module (tests/dist_scenarios.py).
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from tests.fork_server import context

__all__ = ["RankError", "RankPool", "free_port"]


class RankError(AssertionError):
    """A scenario failed on at least one rank (the message has the tracebacks)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the machine's cores are shared by every rank
    # A collective that one rank never joins fails after the timeout instead of hanging.
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))  # fmt: skip
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(rank, world, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        gc.collect()  # DDP/FSDP objects in reference cycles go while the group exists
        dist.destroy_process_group()


class RankPool:
    """`world` processes in a gloo group, running scenario functions on every rank."""

    def __init__(self, world: int, timeout: float = 240.0, preload: Sequence[str] = ()) -> None:
        """`preload`: modules the scenarios need (imported once in the forkserver)."""
        ctx = context(*preload)
        self.world = world
        self.timeout = timeout
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_serve, args=(r, world, port, self._tasks[r], self._results), daemon=True
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in its process."""
        for q in self._tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(self.world):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                raise RankError(f"{fn.__name__}: no answer within {self.timeout} s") from None
            (out if ok else errors)[rank] = value
        if errors:
            raise RankError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop the processes (the ones that do not stop are terminated)."""
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(20)
            if p.is_alive():
                p.terminate()
