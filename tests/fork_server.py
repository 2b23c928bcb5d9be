"""The test process's forkserver, started with what the distributed tests' processes import.

A spawned process is a fresh interpreter: it imports torch and mixprec again (3-4 s of CPU on
the 2-core runner) or Lightning too (13 s), and the distributed tests start dozens. The standard
library's forkserver forks each process from one server that imported them once. What a test
checks stays as under spawn: the target and its arguments are pickled to each process, which
starts with no state of the test process (no threads, no tensors, no process group).

A process has one forkserver, whose preload list applies when it starts, and other code in the
same pytest worker may have started it first (the GPU suite's tests start one preloading json).
`context` therefore restarts it, with the union of everything asked for so far, whenever the
running server is not one it started with those modules. Processes forked earlier keep running;
their exit status reads 255 once their server is gone (the pools only join them to clean up).
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver

__all__ = ["context"]

#: What every server imports: the distributed tests' processes all need these.
BASE = ("torch", "torch.distributed", "mixprec")

_ours: dict = {"pid": None, "modules": frozenset()}


def context(*modules: str) -> multiprocessing.context.BaseContext:
    """The ``"forkserver"`` multiprocessing context, its server preloaded with `BASE` and
    `modules` (importable module names; their children come forked with them imported)."""
    server = forkserver._forkserver
    wanted = frozenset(BASE) | frozenset(modules) | _ours["modules"]
    running = getattr(server, "_forkserver_pid", None)
    if running is None or running != _ours["pid"] or wanted != _ours["modules"]:
        if running is not None:
            server._stop()
        server.set_forkserver_preload(sorted(wanted))
        server.ensure_running()
        _ours.update(pid=server._forkserver_pid, modules=wanted)
    return multiprocessing.get_context("forkserver")
