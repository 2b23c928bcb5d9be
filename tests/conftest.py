"""Shared fixtures. CPU tests always run; CUDA tests carry @pytest.mark.gpu, skip without a GPU."""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker runs torch (and the processes it starts) on its share of
    the cores: with ``-n 2`` on 2 cores, two workers of 2 intra-op threads each kept 4 threads
    spinning on 2 cores, and every parallel region waited at its barrier for a descheduled
    thread (subprocess-heavy tests ran 2-3x slower in the suite than alone)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # Inductor compiles C++ in a pool of cpu_count worker processes, started (each importing
    # torch) the first time a worker compiles: per pytest worker, on cores the other worker
    # uses too. With one core each, compiling in the worker itself is quicker.
    if threads == 1:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1


_share_the_cores()


def _collect_less_often() -> None:
    """Run the cyclic garbage collector less often in the test process.

    A pytest worker holds torch, dynamo, inductor, transformers and Lightning (millions of
    objects), and dynamo's tracing allocates fast, so with Python's default thresholds (700,
    10, 10) every full collection walked them all: on test_trainstep_compiled.py and
    test_graph.py in one process, 27 full collections, and the collector took a quarter of the
    CPU time. At (10,000, 20, 100): 1 full collection, 7% less CPU in all (255 s instead of
    273 s, the same four-way-loaded machine for each setting), 80 MB more peak memory. No test
    relies on when the collector runs: those that need an object gone call ``gc.collect()``.
    """
    gc.set_threshold(10_000, 20, 100)


_collect_less_often()

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _seed_all() -> None:
    """``torch.manual_seed(0)``. Without CUDA, only the CPU generator: torch.manual_seed also
    queues a seed for each lazily initialised device (CUDA, XPU, MTIA), formatting the caller's
    stack for each, about 1 ms a call under pytest, in every test."""
    if HAS_CUDA:
        torch.manual_seed(0)
    else:
        torch.random.default_generator.manual_seed(0)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    _seed_all()
    # Each test leaves the environment as it found it: Lightning's seed_everything (called by the
    # peer tests) exports PL_GLOBAL_SEED, which makes every later Trainer re-seed at setup and
    # changed the data order of the FSDP2 tests that compare Trainer.fit with a hand-written loop.
    env = dict(os.environ)
    yield
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's process-wide state reset before and after the test (Accelerate keeps one
    per process; another ``mixed_precision`` needs a fresh one). Used with ``usefixtures``."""
    from tests.helpers import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()


@contextlib.contextmanager
def fake_cuda() -> Iterator[object]:
    """CUDA tensors without a GPU: FakeTensorMode tensors on device 'cuda'.

    torch's AutocastCUDA kernels run on them (dtype propagation only), so torch.autocast's CUDA
    lists can be checked on a CPU-only machine. ``torch.cuda.is_available`` is patched to True
    so that both autocast implementations enable themselves.
    """
    if torch.version.cuda is not None and not HAS_CUDA:
        # A CUDA build initialises the driver for fake CUDA tensors; a CPU build does not.
        pytest.skip("fake CUDA tensors need a CPU build of torch or a GPU (CUDA build, no driver)")
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True),
        mode,
    ):
        yield mode


@contextlib.contextmanager
def torch_cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """torch.autocast's CUDA kernels, switched on directly (the class refuses without CUDA)."""
    prev_enabled = torch.is_autocast_enabled("cuda")
    prev_dtype = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev_enabled)
        torch.set_autocast_dtype("cuda", prev_dtype)
