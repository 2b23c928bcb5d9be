"""What this device can do, and how much of each workload fits a time budget.

`mixprec bench` first measures the device's matmul rates (`measure_peak`), fp32's and the low
dtype's. They serve twice: as the denominator of the "% peak" column, and to say at the top of
the report what the machine can show (a CPU whose bf16 matmuls run at 1/200 of fp32's cannot
show a mixed-precision speed-up; one with AMX or a GPU can).

The peak is the best rate over square products from small to large (64 to 2048 on a CPU, 1024 to
8192 on a GPU), with all the threads torch uses: fast kernels peak on large products, but the
fallback kernels of CPUs without 16-bit instructions run single-threaded and are fastest on
small, cache-sized ones. A peak measured on one large size only reads far too low there, and
the 16-bit rows then claimed 250-550% of it.

`Budget` splits the seconds left between the workloads still to run; the runner fits sizes and
step counts into each share (see `mixprec.bench.runner`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_CPU_BUDGET_S", "Budget", "Peak", "measure_peak", "rate_statement"]

#: Default budget of a CPU run (seconds of measuring; torch's import and the report come on top).
#: Chosen so that the README's ``mixprec bench`` ends within 2 minutes on a 2-core CPU even when
#: estimates miss by half.
DEFAULT_CPU_BUDGET_S = 60.0

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
           "fp16": torch.float16}  # fmt: skip
_SIZES = {"cpu": (64, 128, 256, 512, 1024, 2048), "cuda": (1024, 2048, 4096, 8192)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Peak:
    """The best matmul rate measured for one dtype, and on which product."""

    name: str
    flops_per_s: float
    n: int  # the side of the square product that reached it
    threads: int  # torch's intra-op threads during the measurement

    @property
    def gflops(self) -> float:
        return self.flops_per_s / 1e9


def measure_peak(device: str, name: str, max_seconds: float = 1.5) -> Peak:
    """Best FLOP/s of square ``n x n`` matmuls in `name` (``fp32``, ``tf32``, ``bf16``, ``fp16``).

    Sizes grow from small to large; each is timed for about 0.05 s (best of the repetitions: a
    peak is what the kernel can do, and other processes only slow it down). A size whose single
    product would take more than a quarter of `max_seconds` at the previous size's rate is not
    tried, so a dtype that runs at 1 GFLOP/s costs about as much to measure as one at 1 TFLOP/s.
    Cost: up to `max_seconds`, plus one synchronisation per product on CUDA.
    """
    dtype = _DTYPES[name]
    sizes = _SIZES["cuda" if device == "cuda" else "cpu"]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    best, best_n, last = 0.0, sizes[0], 0.0
    warm = torch.ones(8, 8, device=device, dtype=dtype)
    warm @ warm  # library start-up (cuBLAS handles, oneDNN), paid before any timing
    _sync(device)
    start = time.perf_counter()
    try:
        for n in sizes:
            work = 2.0 * n**3
            # Predicted from the last size's rate, not the best: slow kernels get slower per
            # FLOP as products outgrow the caches.
            if last and work / last > max_seconds / 4:
                break
            if time.perf_counter() - start > max_seconds:
                break
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            # The first product selects kernels and touches the output: not timed, unless it
            # alone took long, when it is the (lower-bound) measurement of this size.
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            first = max(time.perf_counter() - t0, 1e-9)
            last = work / first
            t_end = time.perf_counter() + 0.05
            reps = 0
            while first <= max_seconds / 8 and (
                reps < 2 or (time.perf_counter() < t_end and reps < 50)
            ):
                t0 = time.perf_counter()
                a @ b
                _sync(device)
                last = max(last, work / max(time.perf_counter() - t0, 1e-9))
                reps += 1
            if last > best:
                best, best_n = last, n
            del a, b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return Peak(name, best, best_n, torch.get_num_threads())


def _ratio(low: float, fp32: float) -> str:
    if low >= fp32:
        return f"{low / fp32:.1f}x fp32's rate"
    return f"1/{fp32 / low:.0f} of fp32's rate" if fp32 / low >= 2 else f"{low / fp32:.2f}x fp32's"


def rate_statement(device: str, fp32: Peak, low: Peak) -> str:
    """One or two sentences: how fast 16-bit matmuls are here, and what that lets a run show."""
    speed = (f"{low.name} matmuls run at {_ratio(low.flops_per_s, fp32.flops_per_s)} here "
             f"({low.gflops:,.0f} vs {fp32.gflops:,.0f} GFLOP/s, best square product, "
             f"{fp32.threads} thread{'s' * (fp32.threads != 1)})")  # fmt: skip
    if low.flops_per_s >= 1.2 * fp32.flops_per_s:
        return speed + ": mixed precision can make the matmul-bound workloads faster."
    if device == "cuda":
        return speed + ": this GPU has no fast 16-bit matmuls for this dtype."
    return (
        speed + f": this CPU has no fast {low.name} kernels, so {low.name} matmuls cannot make "
        "it faster (the TrainStep row computes them in fp32 on the same "
        f"{low.name} values where that is faster here). What holds on any machine is mixprec "
        "against torch.amp at the same sizes; for the speed-up AMP exists for, run on a GPU or a "
        "CPU with AVX512-BF16/AMX."
    )


class Budget:
    """Seconds left of a run's budget, shared equally among the workloads still to run."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()
        # Seconds outside the budget: compiling TrainStep rows, reading memory events (CPU).
        self.excluded = 0.0

    @property
    def elapsed(self) -> float:
        """Wall-clock seconds since the start, compiling included."""
        return time.perf_counter() - self.start

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (compiling, or analysis; timed by the caller) out of the budget."""
        self.excluded += seconds

    def left(self) -> float:
        """Seconds left (infinite without a budget; never below zero)."""
        if self.seconds is None:
            return float("inf")
        return max(self.seconds - (self.elapsed - self.excluded), 0.0)

    def share(self, workloads_left: int) -> float:
        """This workload's share of what is left."""
        return self.left() / max(workloads_left, 1)
