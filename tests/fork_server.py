"""The test process's forkserver, started with what the distributed tests' processes import.

A spawned process is a fresh interpreter: it imports torch and mixprec again (3-4 s of CPU on
the 2-core runner) or Lightning too (13 s), and the distributed tests start dozens. The standard
library's forkserver forks each process from one server that imported them once. What a test
checks stays as under spawn: the target and its arguments are pickled to each process, which
starts with no state of the test process (no threads, no tensors, no process group).

A process has one forkserver, whose preload list applies when it starts, and other code in the
same pytest worker may have started it first (the GPU suite's tests start one preloading json).
`context` therefore restarts it, with the union of everything asked for so far, whenever the
running server is not one it started, or lacks a module asked for outside this repository's
`tests` and `mixprec` packages. Those two are the exception: a scenario module (or a mixprec
module) costs little on top of what its caller lists beside it (torch, Lightning), so a child
imports it when it unpickles its target, and a server that imported Lightning for one test file
serves the next file's scenarios too instead of importing everything again (each restart with
Lightning in it cost 11-16 s of CPU). Processes forked earlier keep running; their exit status
reads 255 once their server is gone (the pools only join them to clean up).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from multiprocessing import forkserver
from pathlib import Path

__all__ = ["context", "run"]

#: What every server imports: the distributed tests' processes all need these. torch._dynamo
#: (2 s of CPU) too: torch imports it in each process that builds its first optimizer.
BASE = ("torch", "torch.distributed", "torch._dynamo", "mixprec")

_ours: dict = {"pid": None, "modules": frozenset()}


def context(*modules: str) -> multiprocessing.context.BaseContext:
    """The ``"forkserver"`` multiprocessing context, its server preloaded with `BASE` and
    `modules` (importable module names; their children come forked with them imported, or,
    for modules of `tests` and `mixprec` that a running server lacks, import them themselves)."""
    server = forkserver._forkserver
    wanted = frozenset(BASE) | frozenset(modules) | _ours["modules"]
    running = getattr(server, "_forkserver_pid", None)
    missing = wanted - _ours["modules"]
    if running is None or running != _ours["pid"] or any(_costly(m) for m in missing):
        if running is not None:
            server._stop()
        server.set_forkserver_preload(sorted(wanted))
        server.ensure_running()
        _ours.update(pid=server._forkserver_pid, modules=wanted)
    return multiprocessing.get_context("forkserver")


def _costly(module: str) -> bool:
    """Whether a child should find `module` imported rather than import it itself."""
    return module.partition(".")[0] not in ("tests", "mixprec")


def run(argv: Sequence[str], *, cwd: str | os.PathLike[str], timeout: float,
        env: dict[str, str] | None = None,
        preload: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``subprocess.run(argv, capture_output=True, text=True)`` for ``python script.py ...`` or
    ``python -m module ...``, forked from the server (`preload` added to its imports) instead of
    a fresh interpreter: its own process, argv, environment (`env`, or this process's), working
    directory, stdout, stderr and exit status. What it runs starts as ``__main__`` does.

    Raises ``subprocess.TimeoutExpired`` (its process group killed) after `timeout` seconds.
    """
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from suite.launch import run_forked  # the GPU suite's launcher: a part starts the same way

    argv = [str(a) for a in argv]
    environ = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="mixprec-fork-") as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        rc, timed_out = run_forked(context(*preload), argv, cwd=str(cwd), env=environ,
                                   log_path=str(out), err_path=str(err),
                                   timeout=timeout)  # fmt: skip
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())
