"""Keep the memory a CPU training step frees, so the next step reuses it without page faults.

A training step on a CPU allocates and frees the same large buffers every step (activations,
gradients, casts). torch's CPU tensors come from the C library's ``malloc``; glibc's returns a
large freed block to the operating system (``munmap``, or trimming the top of the heap), and
the next step's allocation of the same size gets fresh pages, each of which the kernel zeroes
on first touch (a *minor page fault*). Those faults are a large share of a CPU step. Measured
on an AMD EPYC with avx512_bf16 (2 threads, torch 2.13, bf16 autocast, one process per row):
the seed MLP's torch.amp step took 7.8-8.4 ms with 2,200-3,000 faults a step and 4.3 ms with
none; its compiled TrainStep 6.8 ms with about 1,000 faults and 4.7 ms with none.

`keep_cpu_memory` sets glibc's documented ``mallopt`` parameters so that freed memory stays in
the process: blocks up to ``mmap_threshold`` come from the heap rather than from their own
mappings, and the heap is never trimmed below ``trim_threshold`` of free space at its top. It
is what torch's own CPU tuning guide gets from preloading jemalloc or tcmalloc, without a
library to install.

Costs and cautions: the process's resident memory stays at its peak instead of shrinking
between steps (the same peak, kept); it is process-wide (every allocation of the process, not
only mixprec's, and ``enabled=False`` restores glibc's documented defaults but not its dynamic
threshold, which any ``mallopt`` call turns off for the life of the process). Blocks larger than
``mmap_threshold`` (glibc allows at most 32 MiB) are still mapped and unmapped each time. Only
glibc (most Linux distributions) has these parameters: elsewhere nothing changes and the
result says so.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

from mixprec.errors import ArgumentValueError

__all__ = ["CpuMemory", "keep_cpu_memory"]

# glibc's <malloc.h> parameter numbers, and the defaults its manual page documents.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_DEFAULT = 128 * 1024
_MMAP_MAX = 32 * 1024 * 1024  # glibc refuses more (half its 64 MiB heap size on 64-bit)
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class CpuMemory:
    """What `keep_cpu_memory` set, and why.

    Attributes:
        kept: freed memory now stays in the process.
        mmap_threshold, trim_threshold, top_pad: the ``mallopt`` values set (bytes), or None
            where nothing was set.
        reason: the decision in words.
    """

    kept: bool
    mmap_threshold: int | None
    trim_threshold: int | None
    top_pad: int | None
    reason: str

    def __str__(self) -> str:
        return f"CPU memory: {'kept' if self.kept else 'not kept'}: {self.reason}"


def keep_cpu_memory(
    enabled: bool = True,
    *,
    mmap_threshold: int = _MMAP_MAX,
    trim_threshold: int = _INT_MAX,
    top_pad: int = 256 * 1024 * 1024,
) -> CpuMemory:
    """Make the C allocator keep freed memory for reuse (see the module docs for the costs).

    Args:
        enabled: True keeps freed memory; False restores glibc's documented defaults
            (128 KiB for all three).
        mmap_threshold: blocks up to this size come from the heap (at most 32 MiB).
        trim_threshold: free space at the heap's top kept before trimming (at most 2**31-1).
        top_pad: extra heap requested from the system at each growth.

    Returns:
        a `CpuMemory` saying what was set; ``kept=False`` with the reason where the C library
        is not glibc or refused a value (the process is then unchanged or partly changed, as
        the reason says).
    """
    for name, value, top in (("mmap_threshold", mmap_threshold, _MMAP_MAX),
                             ("trim_threshold", trim_threshold, _INT_MAX),
                             ("top_pad", top_pad, _INT_MAX)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise ArgumentValueError(
                f"keep_cpu_memory: {name}={value!r} is not a byte count from 0 to {top:,}; "
                f"leave it out for the default, or give an int in that range."
            )
    libc, version = platform.libc_ver()
    if libc != "glibc":
        why = (f"the C library is {libc or 'unknown'} {version}, not glibc: nothing changed "
               f"(preloading jemalloc or tcmalloc does the same there)")  # fmt: skip
        return CpuMemory(False, None, None, None, why)
    values = (mmap_threshold, trim_threshold, top_pad) if enabled else (_DEFAULT,) * 3
    mallopt = ctypes.CDLL(None).mallopt
    done = []
    for param, name, value in zip((_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, _M_TOP_PAD),
                                  ("M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD", "M_TOP_PAD"),
                                  values, strict=True):  # fmt: skip
        if mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            return CpuMemory(False, None, None, None,
                             f"glibc {version} refused mallopt({name}, {value}); set before it:"
                             f" {', '.join(done) or 'nothing'}")  # fmt: skip
        done.append(f"{name}={value:,}")
    mmap, trim, pad = values
    if enabled:
        why = (f"glibc {version}: blocks up to {mmap:,} bytes come from the heap, which keeps up "
               f"to {trim:,} free bytes at its top ({', '.join(done)}); a step reuses the last "
               f"step's pages instead of faulting in fresh ones")  # fmt: skip
    else:
        why = f"glibc {version}: its documented defaults restored ({', '.join(done)})"
    return CpuMemory(enabled, mmap, trim, pad, why)
