"""Peak memory of one training step on a CPU, from the allocator's own events.

CUDA's caching allocator counts its peak (``torch.cuda.max_memory_allocated``); torch's CPU
allocator keeps no such counter, and the process's resident size says little (the C library
keeps freed memory, and other rows' tensors share the process). torch's profiler, with
``profile_memory=True``, records every allocation and free of torch's CPU allocator, and its
memory timeline (``export_memory_timeline``) attributes each live tensor to a category
(parameters, gradients, optimizer state, activations, temporaries); its largest total over the
step is the figure reported here: the bytes torch had allocated for this step's tensors at the
step's busiest moment, parameters and optimizer state included.

Cost: one extra step runs under the profiler (about as fast as a plain step), after a first
warm-up step: the first step's one-time work is not the step's memory, and its events made the
timeline slow to build (21 s for an O1 row, 0.4 s from the second step). Building it takes
0.1-2.5 s per row on two cores (the ResNet-50 rows the longest); the benchmark leaves that out
of its time budget and reports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["METHOD", "cpu_peak_mib"]

#: How the CPU figure is measured, in words (the table's footnote and the JSON's metadata).
METHOD = "torch.profiler memory timeline (CPU allocator events), one extra step per row"


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Native code's writes to standard error go nowhere inside the block.

    torch 2.13's profiler (kineto) writes a line to file descriptor 2 at each start and stop
    ("USDT:... profiler_start"), and torch's CPU allocator one when a block allocated before the
    start is freed under the profiler: native writes Python cannot filter, breaking up the
    progress line several times a row. An error inside the block still reaches the caller
    (as an exception); a crash's native message would not.
    """
    fd = 2  # C's stderr, where native code writes, whatever Python's sys.stderr is now
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def cpu_peak_mib(step: Callable[[], Any]) -> tuple[float | None, float]:
    """Run `step` once under torch's profiler; return the largest total of its memory timeline
    in MiB (None when the profiler cannot build it here: the row then shows no figure) and the
    seconds the step itself took (the rest, building the timeline, is analysis)."""
    from torch.profiler import ProfilerActivity, profile

    path = os.path.join(tempfile.mkdtemp(prefix="mixprec-mem-"), "timeline.json")
    seconds = 0.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "memory block of unknown size": allocated before
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                           record_shapes=True, with_stack=True)  # fmt: skip
            with _native_stderr_muted(), prof:
                start = time.perf_counter()
                step()
                seconds = time.perf_counter() - start
            prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _times, sizes = json.load(f)
    except Exception:  # a profiler that cannot attribute this step: no figure, not a failure
        return None, seconds
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(os.path.dirname(path))
    if not sizes:
        return None, seconds
    return max(sum(row) for row in sizes) / 2**20, seconds
