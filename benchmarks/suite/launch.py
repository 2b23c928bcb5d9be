"""How a part's process starts: forked from a server that imported torch once, or fresh.

A fresh interpreter pays for torch's import (about 2 s), torch._dynamo's (2 s), inductor's and
mixprec's before a part does anything: about 5 s a part, a third of the suite's CPU smoke run and
a minute and a half of a GPU call's device time. `Preloaded` starts one server with the standard
library's forkserver (`multiprocessing`, start method "forkserver") in the parts' environment,
has it import those modules once, and forks every part from it. The server only imports: it
initializes no CUDA context and starts no thread pool, so each child starts as clean as a fresh
interpreter that ran the same imports.

What a forked part keeps from a fresh one: its own process, its own process group (a timeout
ends it and everything it started: pytest's workers, compile workers, torchrun's ranks), its
log as stdout and stderr, its exit status, ``sys.argv`` and ``__main__`` as ``python script.py``
or ``python -m module`` would set them (`runpy`; multiprocessing's spawn in a part re-imports
the right main module). What it cannot have: environment variables read while torch imports
differ per part (every part shares the suite's one environment, which the server starts with).
The objects it inherits are frozen (`gc.freeze`): the cyclic collector skips them, which
loses nothing, since the imports keep them alive anyway. Other command lines (another
executable, ``python -c``) start fresh. As with any forkserver, the main module of the process
that starts the parts must be safe to import (its work under ``if __name__ == "__main__":``):
each child imports it as ``__mp_main__``.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import runpy
import signal
import sys
from collections.abc import Iterator, Sequence
from multiprocessing import forkserver

#: What the server imports before forking (modules that fail to import are left out).
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "mixprec")

_CANARY = """
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.ones(64, device=device)
assert float((x * 2).sum()) == 128.0, "wrong result"
print("canary ok on", device)
"""


def _child(argv: Sequence[str], cwd: str, env: dict[str, str], log_path: str,
           err_path: str | None = None) -> None:  # fmt: skip
    """Runs in the forked child: become `argv` (``python script.py ...`` or ``python -m mod``).

    multiprocessing's bootstrap turns a ``SystemExit`` into the exit status, prints an uncaught
    exception's traceback (into the log) and exits 1, and flushes the standard streams.
    """
    os.setpgid(0, 0)  # a group of its own (not a new session: the device ends only its own)
    # The objects the server imported (torch's, mixprec's: some 400,000) leave the collector's
    # generations: its full collections (pytest runs two, dynamo's tracing triggers some) would
    # traverse them all and write their headers, copying the server's pages (0.3-0.5 s a part).
    gc.freeze()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for path, targets in ((log_path, (1,) if err_path else (1, 2)), (err_path, (2,))):
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            for target in targets:
                os.dup2(fd, target)
            os.close(fd)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path.insert(0, cwd)
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv[1:])
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
        runpy.run_path(argv[1], run_name="__main__")


@contextlib.contextmanager
def _as_parts_see_it(env: dict[str, str]) -> Iterator[None]:
    """This process's environment and import path as a part's, while the server starts (it
    inherits the environment and takes ``sys.path`` from here)."""
    saved_env, saved_path = dict(os.environ), list(sys.path)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = extra + [p for p in sys.path if p not in extra]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path


class Preloaded:
    """Forks parts from one forkserver that imported `preload` in the parts' environment `env`.

    Raises OSError (or ValueError) from the constructor where the server cannot start; the
    caller then starts parts fresh.
    """

    def __init__(self, env: dict[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self.env = dict(env)
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(list(preload))
        with _as_parts_see_it(self.env):
            forkserver.ensure_running()
        self.description = (f"forked from one server that imported {', '.join(preload)} once "
                            f"(multiprocessing forkserver)")  # fmt: skip

    def works(self, work_dir: str, timeout: float = 120.0) -> str | None:
        """None if a forked child can use the device; else what went wrong (start parts fresh).

        The canary runs a tensor operation on the GPU where the parts see one: a server whose
        imports had initialized the CUDA driver would leave its children unable to (the
        driver does not survive a fork); this finds out in a second, not in every part.
        """
        os.makedirs(work_dir, exist_ok=True)
        script = os.path.join(work_dir, "canary.py")
        with open(script, "w") as fh:
            fh.write(_CANARY)
        log = os.path.join(work_dir, "canary.log")
        rc, timed_out = self.run([sys.executable, script], cwd=work_dir, log_path=log,
                                 timeout=timeout)  # fmt: skip
        if rc == 0:
            return None
        with open(log, errors="replace") as fh:
            last = fh.read().strip().splitlines()[-1:] or ["(no output)"]
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {rc}"
        return f"a forked canary failed ({why}): {last[0][:300]}"

    def close(self) -> None:
        """Stop the server. A process has one forkserver, whose preload applies when it starts:
        stopping it lets later users in this process (a test run) start one with theirs."""
        stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's, since 3.8
        if stop is not None:
            stop()

    @staticmethod
    def handles(argv: Sequence[str]) -> bool:
        """Whether `argv` is this interpreter running a script or a module."""
        if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return False
        return (argv[1] == "-m" and len(argv) >= 3) or argv[1].endswith(".py")

    def run(self, argv: Sequence[str], *, cwd: str, log_path: str, timeout: float,
            err_path: str | None = None) -> tuple[int | None, bool]:  # fmt: skip
        """Run `argv` forked, output appended to `log_path` (its stderr to `err_path`, if
        given): (exit status, timed out).

        The exit status is the script's (``SystemExit``), 1 after an uncaught exception (its
        traceback is in the log), minus the signal's number when a signal ended it.
        """
        return run_forked(self._ctx, argv, cwd=cwd, env=self.env, log_path=log_path,
                          timeout=timeout, err_path=err_path)  # fmt: skip


def run_forked(ctx: multiprocessing.context.BaseContext, argv: Sequence[str], *, cwd: str,
               env: dict[str, str], log_path: str, timeout: float,
               err_path: str | None = None) -> tuple[int | None, bool]:  # fmt: skip
    """`Preloaded.run` on any forkserver context `ctx` and environment `env` (the tests'
    server, tests/fork_server.py, runs scripts this way too)."""
    name = os.path.basename(argv[2] if argv[1] == "-m" else argv[1])
    proc = ctx.Process(target=_child, name=name, args=(list(argv), cwd, env, log_path, err_path))
    proc.start()
    try:
        proc.join(timeout)
    except BaseException:  # the suite was stopped (SIGTERM, SIGINT): end the part first
        _kill_group(proc)
        raise
    if proc.exitcode is None:
        _kill_group(proc)
        return None, True
    return proc.exitcode, False


def _kill_group(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM, then SIGKILL, to the part's process group (the child made it its own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # type: ignore[arg-type]
        except (ProcessLookupError, PermissionError):
            proc.kill()  # not yet in a group of its own (killed at once after it started)
        proc.join(5.0)
        if proc.exitcode is not None:
            return
