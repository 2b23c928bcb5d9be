"""Peak memory of one training step on a CPU, from the allocator's own events.

CUDA's caching allocator counts its peak (``torch.cuda.max_memory_allocated``); torch's CPU
allocator keeps no such counter, and the process's resident size says little (the C library
keeps freed memory, and other rows' tensors share the process). torch's profiler, with
``profile_memory=True``, records every allocation and free of torch's CPU allocator during the
step, and with ``record_shapes=True`` every tensor each op reads. The figure reported here is
the bytes torch had allocated for this step's tensors at the step's busiest moment: the tensors
allocated during the step, plus those that existed before it and that the step reads
(parameters, optimizer state, the batch), each counted from the step's start until it is freed.

That is the total torch's own memory timeline (``export_memory_timeline``) plots, summed over
its categories, computed here from the same events in one pass instead: torch's timeline also
sorts every tensor into a category (parameter, gradient, activation...) through a data-flow
analysis of the whole step that took 0.05-5 s a row on two cores (the ResNet-50 rows the
longest; this pass takes a tenth of that or less), needs the Python stack recorded (a slower
profiled step), and is deprecated in torch 2.13. The test suite checks the two totals agree
where torch still has the timeline. One bookkeeping rule is torch's: a tensor that existed
before the step is sized by the largest extent (sizes x strides) it was read with. One is
not: a block allocated before the step and freed during it without being read is not counted
(the allocator reports its size only if it kept it, which depends on what ran before in the
process). The peak is taken after each event, so two blocks alive together, however briefly,
both count (torch's timeline takes it per microsecond).

Cost: one extra step runs under the profiler (a little slower than a plain step), after a first
warm-up step, whose one-time work is not the step's memory; reading its events takes 0.005-0.4 s.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["METHOD", "cpu_peak_mib", "peak_bytes"]

#: How the CPU figure is measured, in words (the table's footnote and the JSON's metadata).
METHOD = "torch.profiler allocation events (CPU allocator), one extra step per row"


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


def _events_in_time_order(roots: Iterable[Any]) -> list[Any]:
    events, todo = [], list(roots)
    while todo:
        event = todo.pop()
        events.append(event)
        todo.extend(event.children)
    events.sort(key=lambda e: e.start_time_ns)  # stable: ties keep the tree's order
    return events


def _read_tensors(op: Any) -> Iterator[Any]:
    for arg in op.inputs:  # a tensor, a list of tensors (TensorList), or anything else
        for t in arg if isinstance(arg, list) else (arg,):
            if hasattr(t, "storage_data_ptr") and t.layout == torch.strided:
                yield t


def _extent_bytes(t: Any) -> int:
    """Bytes from a tensor's first element to one past its last (torch's SizeMap rule)."""
    extents = (size * stride for size, stride in zip(t.sizes, t.strides, strict=True))
    return max(extents, default=1) * t.dtype.itemsize  # a 0-d tensor: one element


def peak_bytes(
    prof: torch.profiler.profile, device: str = "cpu", held: Iterable[tuple[int, int]] = ()
) -> int:
    """The step's peak of live tensor bytes on `device`, from a finished profile's events.

    `prof` must have run with ``profile_memory=True`` and ``record_shapes=True``. `held` are
    (address, bytes) of storages known to have lived through the whole step (training state
    compiled code reads without a recorded op); those the events did not show are added.
    """
    from torch._C._profiler import _EventType

    dev = torch.device(device).type
    fresh: dict[int, int] = {}  # blocks allocated during the step: address -> bytes
    before: dict[int, int] = {}  # blocks that existed before it, as the step met them
    live = peak = 0  # bytes live now and at most, counting from the step's start

    def since_start(n: int) -> None:  # n more bytes held from the step's start until now
        nonlocal live, peak
        live += n
        peak += n  # every earlier moment held them too

    for event in _events_in_time_order(prof.profiler.kineto_results.experimental_event_tree()):
        kind, fields = event.typed
        if kind == _EventType.Allocation:
            if fields.device.type != dev:
                continue
            if fields.alloc_size > 0:
                fresh[fields.ptr] = fields.alloc_size
                live += fields.alloc_size
            elif fields.ptr in fresh:
                live -= fresh.pop(fields.ptr)
            elif fields.ptr in before:
                live -= before.pop(fields.ptr)
            # else: a block from before the step, freed unread: not counted. The allocator
            # reports such a free only where it kept the block's size (allocated under an
            # earlier profiler, or a stale entry at a reused address, with that entry's
            # size), so counting it made the figure depend on the process's history.
        elif kind == _EventType.TorchOp:
            for t in _read_tensors(fields):
                ptr = t.storage_data_ptr
                if t.device.type != dev or ptr is None or ptr in fresh:
                    continue
                grown = _extent_bytes(t) - before.get(ptr, 0)
                if grown > 0:  # first met, or read further than before
                    before[ptr] = before.get(ptr, 0) + grown
                    since_start(grown)
        peak = max(peak, live)
    for ptr, n in dict(held).items():
        if ptr not in fresh and n > before.get(ptr, 0):
            since_start(n - before.get(ptr, 0))
    return peak


def cpu_peak_mib(
    step: Callable[[], Any], held: Iterable[torch.Tensor] = ()
) -> tuple[float | None, float]:
    """Run `step` once under torch's profiler; return its peak of live tensor memory in MiB
    (`peak_bytes`; None when the profiler cannot tell here: the row then shows no figure) and
    the seconds the step itself took (the rest, reading the events, is analysis).

    `held`: the training state the step keeps between steps (weights, gradients, optimizer
    state: `mixprec.optim.report.state_tensors`). A compiled step reads it inside its kernels,
    where the profiler records no op, so the events alone miss it; each such tensor still
    alive after the step, on the same storage, counts from the step's start. `held` is read
    before the step and not kept: pass a generator, not a list held elsewhere, or a gradient the
    step frees would stay alive and count twice.
    """
    from torch.profiler import ProfilerActivity, profile

    def storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[int, Any]]:
        out = {}  # weak references only: the step may free a gradient held here
        for t in tensors:
            if t.device.type == "cpu" and t.layout == torch.strided:
                s = t.untyped_storage()
                out[s.data_ptr()] = (s.nbytes(), weakref.ref(t))
        return out

    seconds = 0.0
    try:
        state = storages(held)
        del held
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "memory block of unknown size": allocated before
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                           record_shapes=True)  # fmt: skip
            with _native_stderr_muted(), prof:
                start = time.perf_counter()
                step()
                seconds = time.perf_counter() - start
        kept = [(p, n) for p, (n, ref) in state.items()
                if (t := ref()) is not None and t.untyped_storage().data_ptr() == p]  # fmt: skip
        peak = peak_bytes(prof, "cpu", kept)
    except Exception:  # a profiler that cannot attribute this step: no figure, not a failure
        return None, seconds
    return (peak / 2**20 if peak else None), seconds
