"""Run workloads x variants side by side, within a time budget, and collect one row per pair.

Per row: the median of the per-step times after warm-up (each step synchronized), peak memory
(CUDA's allocator; on a CPU, torch's profiler: `mixprec.bench.memory`), the final loss, and the
share of the device's peak matmul rate (the peak measured at the start of the same run, see
`mixprec.bench.budget`; the step's matmul FLOPs counted by ``torch.utils.flop_counter`` on meta
tensors). Speed-ups compare rows of the same workload at the same size in the same run.

With a budget (the CPU default), each workload gets an equal share of the seconds left. The
variants split into a class that multiplies in fp32 (fp32, tf32) and a 16-bit class (torch.amp,
O1-O3, TrainStep); each class runs at the largest size of the workload's ladder at which one
step fits its share (`_fit`: the first step of the class's first variant measures it), and then
with as many steps as fit (at least `MIN_STEPS`, at most the workload's own). When the 16-bit
class needs a smaller size than fp32, it gets its own block with an fp32 row at that size, so
every ratio in the table compares equal sizes; the size is labelled "reduced".

On a CPU the variants of a block take turns step by step (interleaved): a burst of load from
another process then slows all of them alike instead of one row. On CUDA they run one after
another, so that each row's peak memory is its own.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mixprec.bench.budget import Budget, Peak, measure_peak, rate_statement
from mixprec.bench.memory import METHOD, cpu_peak_mib
from mixprec.bench.variants import VARIANTS, Variant
from mixprec.bench.workloads import WORKLOADS, Workload, WorkloadSize
from mixprec.dtypes import dtype_name

__all__ = ["MIN_STEPS", "Progress", "measure_peak", "run"]

#: Timed steps per row below which a budgeted run takes a smaller size instead.
MIN_STEPS = 5
#: Fewest timed steps a row ever has: a block past its deadline stops there.
_FLOOR_STEPS = 3


class Progress(Protocol):
    """Progress callback: `label` says what runs now; `done` items finished; `total` re-set."""

    def __call__(self, label: str, done: int = 0, total: int | None = None) -> None: ...


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _flops(workload: Workload, size: WorkloadSize, device: str) -> float:
    """Matmul/convolution FLOPs of one forward+backward, counted on meta tensors (no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    try:
        with torch.device("meta"):
            model, batch = workload.build(size.params, "meta")
            with counter:
                workload.loss(model(batch[0]), batch).backward()
    except (NotImplementedError, RuntimeError):  # an op without a meta kernel: count for real
        torch.manual_seed(0)
        model, batch = workload.build(size.params, device)
        counter = FlopCounterMode(display=False)
        with counter:
            workload.loss(model(batch[0]), batch).backward()
    return float(counter.get_total_flops())


@dataclass
class _Member:
    """One variant built at one size, with the times of its steps so far."""

    variant: Variant
    step: Callable[[], torch.Tensor]
    cleanup: Callable[[], None]
    compile_s: float | None = None  # seconds spent compiling at build time (TrainStep)
    built_steps: int = 0  # training steps taken while built (TrainStep's compile steps)
    warm: list[float] = field(default_factory=list)  # untimed-for-the-table steps
    times: list[float] = field(default_factory=list)
    loss: torch.Tensor | None = None
    peak_mib: float | None = None

    def run(self, device: str, timed: bool) -> float:
        t0 = time.perf_counter()
        # detached: the loss's graph reaches every parameter and its gradient (AccumulateGrad),
        # which would keep a closed member's model alive and in the next rows' peak memory
        self.loss = self.step().detach()
        _sync(device)
        seconds = time.perf_counter() - t0
        (self.times if timed else self.warm).append(seconds)
        return seconds

    def close(self, device: str, collect: bool = True) -> None:
        """Drop the model and optimizer; `collect` frees them now (one gc pass, which takes
        long in a big heap: a block of members collects once, after the last)."""
        self.cleanup()
        self.step = self.cleanup = _closed
        if collect:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


def _closed() -> Any:  # pragma: no cover - a closed member is never stepped
    raise RuntimeError("this benchmark member was closed")


@dataclass
class _Workload:
    """Everything one workload's run needs: where, what, and its ladder of sizes."""

    workload: Workload
    ladder: tuple[WorkloadSize, ...]
    device: str
    dtype: torch.dtype
    dist: Any = None  # a mixprec.distributed.launch.DistContext: every variant runs under DDP
    flops: dict[int, float] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return 1 if self.dist is None else self.dist.world_size

    def flops_at(self, level: int) -> float:
        """Counted matmul FLOPs of one step (for the table)."""
        if level not in self.flops:
            self.flops[level] = _flops(self.workload, self.ladder[level], self.device)
        return self.flops[level]

    def cost(self, level: int) -> float:
        """Estimated FLOPs (for planning: counting costs a slow forward per size)."""
        estimate = self.workload.cost
        return estimate(self.ladder[level].params) if estimate else self.flops_at(level)

    def build(self, variant: Variant, level: int) -> _Member:
        extra = {} if self.dist is None else {"dist": self.dist}
        step, cleanup = variant.build(self.workload, self.ladder[level], self.device, self.dtype,
                                      **extra)  # fmt: skip
        return _Member(variant, step, cleanup, getattr(step, "compile_s", None),
                       getattr(step, "built_steps", 0))  # fmt: skip


def _start_level(w: _Workload, first: int, rate: float, allow: float) -> int:
    """The largest size that could fit `allow` seconds per step even at the peak `rate`."""
    level = first
    while level < len(w.ladder) - 1 and w.cost(level) / rate > allow:
        level += 1
    return level


def _fit(w: _Workload, variant: Variant, first: int, rate: float, allow: float,
         keep: bool, give_up: float) -> tuple[int, _Member | None, float]:  # fmt: skip
    """Find the largest size from `first` down at which one step of `variant` takes <= `allow`.

    The step is measured, not predicted: the first step at a candidate size (two when the first
    may have paid one-time costs) decides, and a size too slow sends the search down as many
    sizes as the measured time says; after `give_up` (a time) it takes the smallest. Returns
    the size, the built member (None unless `keep`) and the seconds per step.
    """
    level = _start_level(w, first, rate, allow)
    last = len(w.ladder) - 1
    while True:
        member = w.build(variant, level)
        seconds = member.run(w.device, timed=False)
        if allow < seconds <= 4 * allow:
            seconds = member.run(w.device, timed=False)
        if seconds <= allow or level == last:
            if not keep:
                member.close(w.device)
                member = None
            return level, member, seconds
        member.close(w.device, collect=w.device == "cuda")
        nxt = level + 1
        while nxt < last and seconds * w.cost(nxt) / w.cost(level) > allow:
            nxt += 1
        # Past `give_up` (heavy load makes every size look slow): stop, take the smallest.
        level = last if time.perf_counter() > give_up else nxt


def _steps(size: WorkloadSize, round_s: float, seconds: float, done: int) -> tuple[int, int]:
    """(warm-up, timed steps) per member, `done` warm-up steps run: the workload's own counts
    when a round of steps taking `round_s` fits `seconds` that often, else fewer."""
    if round_s * (size.warmup - done + size.steps) <= seconds:
        return size.warmup, size.steps
    return done, max(MIN_STEPS, int(seconds / max(round_s, 1e-9)))


def _time_block(
    w: _Workload, block: list[Variant], level: int, seconds: float,
    probes: dict[tuple[str, int], _Member], steps: int | None, warmup: int | None,
    interleave: bool, label: Callable[[str], None], clock: Budget | None = None,
) -> tuple[list[_Member], int, int]:  # fmt: skip
    """Warm up and time every variant of a block at one size, in turns when `interleave`.

    Returns the members (closed, with their times) and the (warm-up, timed) steps each ran.
    """
    size = w.ladder[level]
    where = f"{w.workload.name} @ {size.description}"
    end = time.perf_counter() + seconds
    # A row that trains while it is built (the compiled TrainStep) is that many updates ahead;
    # every other row takes as many untimed steps first, so that all rows' final losses come
    # after the same number of updates.
    built = max(v.steps_when_built(w.device, w.world_size > 1) for v in block)

    def member(v: Variant) -> _Member:
        nonlocal end
        m = probes.pop((v.name, level), None)
        if m is None:
            label(f"{where}: {v.preparing(w.device, w.world_size > 1)}")
            m = w.build(v, level)
        for _ in range(built - m.built_steps):
            m.loss = m.step().detach()
        m.built_steps = built
        if m.compile_s:  # compiling is reported on its own, outside the budget
            end += m.compile_s
            if clock is not None:
                clock.exclude(m.compile_s)
        return m

    # Under DDP every rank must run the same steps (each is a collective): counts are fixed,
    # never derived from this rank's clock.
    fixed = steps is not None or warmup is not None or w.world_size > 1
    # Warm-up steps run before the step count is chosen; the first pays one-time costs (kernel
    # selection, lazy state), so the estimate comes from the second where there is one.
    pre = min(2, size.warmup) if not fixed else (size.warmup if warmup is None else warmup)

    def counts(round_s: float, seconds: float) -> tuple[int, int]:
        if fixed:
            return pre, steps or size.steps
        return _steps(size, round_s, seconds, pre)

    if interleave:
        members = [member(v) for v in block]
        for m in members:
            if len(m.warm) < pre:
                label(f"{where}: warming up {m.variant.name}")
            if w.device == "cpu" and m.peak_mib is None:
                # Peak memory from one extra step run under the profiler (bench.memory), after
                # the first warm-up step and before the last: the first pays one-time costs
                # (lazy state, first-call setup) that are not the step's memory; the last
                # one's time sizes the timed steps. Reading the events is analysis, outside
                # the budget like compiling.
                if not m.warm:
                    m.run(w.device, timed=False)
                start = time.perf_counter()
                # (the state as a generator: a list kept here would keep alive the gradients
                # the step frees, and they would count twice)
                m.peak_mib, step_s = cpu_peak_mib(m.step, getattr(m.step, "state", tuple)())
                analysis = time.perf_counter() - start - step_s
                end += analysis
                if clock is not None:
                    clock.exclude(analysis)
            # Past the deadline already (steps much slower than planned): one warm-up only.
            while len(m.warm) < (pre if fixed or time.perf_counter() < end else min(pre, 1)):
                m.run(w.device, timed=False)
        round_s = sum(m.warm[-1] for m in members if m.warm)
        n_warm, n_steps = counts(round_s, end - time.perf_counter())
        for m in members:
            while len(m.warm) < n_warm:
                m.run(w.device, timed=False)
        names = ", ".join(m.variant.name for m in members)
        done = 0
        while done < n_steps:
            label(f"{where}: {names} in turns, step {done + 1}/{n_steps}")
            for m in members:
                m.run(w.device, timed=True)
            done += 1
            # Steps much slower than the warm-up said (a burst of load): stop at the deadline,
            # keeping a median of at least _FLOOR_STEPS, rather than overrun the budget.
            if not fixed and done >= _FLOOR_STEPS and time.perf_counter() > end:
                break
        for i, m in enumerate(members):
            m.close(w.device, collect=i == len(members) - 1)
        return members, n_warm, done
    # One after another (CUDA): each variant alone on the device, so its peak memory is its own.
    members, n_warm, n_steps = [], 0, 0
    for v in block:
        label(f"{where}: {v.name}")
        m = member(v)
        while len(m.warm) < pre:
            m.run(w.device, timed=False)
        left = (end - time.perf_counter()) / (len(block) - len(members))
        n_warm, n_steps = counts(m.warm[-1] if m.warm else 0.0, left)
        while len(m.warm) < n_warm:
            m.run(w.device, timed=False)
        if w.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(n_steps):
            m.run(w.device, timed=True)
        if w.device == "cuda":
            m.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        m.close(w.device)
        members.append(m)
    return members, n_warm, n_steps


def run(
    workloads: Iterable[str],
    variants: Iterable[str],
    *,
    device: str,
    dtype: torch.dtype,
    full: bool,
    steps: int | None = None,
    warmup: int | None = None,
    budget: float | None = None,
    progress: Progress | None = None,
    note: Callable[[str], None] | None = None,
    dist: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every (workload, variant) pair; return the rows and what the run found out.

    Args:
        workloads, variants: names from `WORKLOADS` and `VARIANTS`.
        device, dtype: where, and the low dtype of the 16-bit variants.
        full: start from the seeds' sizes (on CUDA they are the default anyway).
        steps, warmup: fixed step counts (sizes are still fitted to a budget).
        budget: seconds for the whole run (None: the default sizes and steps, however long).
        progress: told what runs now, and when items finish.
        note: told, once the rates are measured, what this machine can show.
        dist: a `mixprec.distributed.launch.DistContext`: every variant runs data-parallel
            under DDP, the workload's batch per rank; rows are this rank's timings. Sizes and
            step counts are then not fitted to a budget: every rank must run the same steps.

    Returns:
        ``(rows, info)``: one row per pair (skipped ones with a reason; a workload whose 16-bit
        rows needed a smaller size than its fp32 rows has a second fp32 row at that size), and
        ``info``: the measured peaks, the statement of what this machine can show, the budget,
        the seconds taken and which workloads ran at reduced sizes.
    """
    workloads, variants = list(workloads), list(variants)
    report: Progress = progress or (lambda label, done=0, total=None: None)
    no_budget = None
    if dist is not None and dist.world_size > 1 and budget is not None:
        # A budget fits sizes to this rank's clock, and every rank must run the same sizes
        # and steps (each step is a collective): the default ones, and the report says why.
        budget, no_budget = None, "data-parallel ranks run the same sizes and steps"
    clock = Budget(budget)
    load = [_load()]
    interleave = device != "cuda" and not full
    runnable = [v for v in variants if VARIANTS[v].available(device, dtype)[0]]
    total = 1 + len(workloads) * len(variants)
    report("measuring the device's matmul rates", 0, total)
    names = {VARIANTS[v].matmul_dtype(dtype) for v in runnable} | {"fp32", dtype_name(dtype)}
    each = 1.5 if budget is None else min(1.5, budget / 20)
    peaks = {n: measure_peak(device, n, each) for n in sorted(names)}
    statement = rate_statement(device, peaks["fp32"], peaks[dtype_name(dtype)])
    if note is not None:
        note("What this machine can show: " + statement)
    report("measured the matmul rates", 1)

    rows: list[dict[str, Any]] = []
    for i, wname in enumerate(workloads):
        w = _Workload(WORKLOADS[wname], WORKLOADS[wname].ladder(full, device), device, dtype,
                      dist)  # fmt: skip
        share = clock.share(len(workloads) - i)
        new_rows = _run_workload(w, variants, runnable, peaks, share, steps, warmup,
                                 interleave, budget is not None, report, clock)  # fmt: skip
        extra = len(new_rows) - len(variants)
        if extra:
            total += extra
        report(f"{wname}: done", len(new_rows), total)
        rows.extend(new_rows)
    low = peaks[dtype_name(dtype)]
    load.append(_load())
    info: dict[str, Any] = {
        # The 1-minute load average before and after (None where the OS does not say): the
        # run itself adds up to its thread count, so much more means other processes shared
        # the CPUs and slowed every step.
        "load_average_before": load[0],
        "load_average_after": load[1],
        "cpu_count": os.cpu_count(),
        "budget_s": budget,
        "no_budget_reason": no_budget,
        "steps_given": steps is not None or warmup is not None,
        "elapsed_s": clock.elapsed,
        # Seconds outside the budget: compiling TrainStep rows and reading the profiler's memory
        # events (CPU), reported.
        "outside_budget_s": clock.excluded,
        "statement": statement,
        "interleaved": interleave,
        "low_dtype": low.name,
        "low_vs_fp32_rate": low.flops_per_s / peaks["fp32"].flops_per_s,
        "memory_method": METHOD if device == "cpu" else "torch.cuda.max_memory_allocated",
    }
    for n, p in peaks.items():  # flat keys: every JSON record carries them (pandas columns)
        info[f"peak_gflops_{n}"] = p.gflops
        info[f"peak_matmul_n_{n}"] = p.n
    return rows, info


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every OS
        return None


def _run_workload(w: _Workload, variants: list[str], runnable: list[str],
                  peaks: dict[str, Peak], share: float, steps: int | None, warmup: int | None,
                  interleave: bool, fitted: bool, label: Callable[[str], None],
                  clock: Budget | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One workload: fit its sizes to `share` seconds, time the blocks, build the rows."""
    deadline = time.perf_counter() + share
    fp_class = [VARIANTS[v] for v in variants if v in runnable and not VARIANTS[v].low_precision]
    low_class = [VARIANTS[v] for v in variants if v in runnable and VARIANTS[v].low_precision]
    n = len(fp_class) + len(low_class)
    # Per-step time a size may take: every member can then run a warm-up and MIN_STEPS steps.
    allow = share / max(n * (MIN_STEPS + 1), 1)
    probes: dict[tuple[str, int], _Member] = {}
    level_fp = level_low = 0
    name = w.workload.name
    for cls in (fp_class, low_class):
        if not (fitted and cls):
            continue
        label(f"{name}: finding the size at which {cls[0].name} fits the budget")
        rate = peaks[cls[0].matmul_dtype(w.dtype)].flops_per_s
        first = level_fp if cls is low_class else 0  # 16-bit rows never larger than fp32's
        give_up = time.perf_counter() + share / 2  # past that, take the smallest size
        level, kept, _ = _fit(w, cls[0], first, rate, allow, interleave, give_up)
        if kept is not None:
            probes[(cls[0].name, level)] = kept
        if cls is fp_class:
            level_fp = level_low = level
        else:
            level_low = level
    if level_low == level_fp or not fp_class or not low_class:
        blocks = [(level_low, fp_class + low_class)]
    else:  # the 16-bit rows at a smaller size, with an fp32 row beside them at that size
        blocks = [(level_fp, fp_class), (level_low, [v for v in fp_class if v.name == "fp32"]
                                         + low_class)]  # fmt: skip
    blocks = [(level, block) for level, block in blocks if block]
    timed = []
    for b, (level, block) in enumerate(blocks):
        excluded = clock.excluded if clock is not None else 0.0
        left = max(deadline - time.perf_counter(), 0.0) if fitted else float("inf")
        seconds = left * len(block) / sum(len(x) for _, x in blocks[b:])
        timed.append((level, *_time_block(w, block, level, seconds, probes, steps, warmup,
                                          interleave, label, clock)))  # fmt: skip
        if clock is not None:  # the next blocks' deadline moves by what compiling took
            deadline += clock.excluded - excluded
    for m in probes.values():  # a probe at a size no block used
        m.close(w.device, collect=False)

    rows = []
    for level, members, n_warm, n_steps in timed:
        block_rows = [_row(w, m.variant, level, m, n_warm, n_steps, peaks) for m in members]
        _speedups(block_rows)
        rows.extend(block_rows)
    # Skipped variants are listed in the block of the 16-bit rows (the last), with the reason.
    last = timed[-1][0] if timed else 0
    rows += [_row(w, VARIANTS[v], last, None, 0, 0, peaks) for v in variants if v not in runnable]
    order = {v: i for i, v in enumerate(variants)}
    rows.sort(key=lambda r: (r["size_level"], order[r["variant"]]))
    return rows


def _row(w: _Workload, variant: Variant, level: int, member: _Member | None, n_warm: int,
         n_steps: int, peaks: dict[str, Peak]) -> dict[str, Any]:  # fmt: skip
    size = w.ladder[level]
    row: dict[str, Any] = {
        "workload": w.workload.name, "size": size.description, "size_level": level,
        "reduced": level > 0,  # smaller than this run's default size, to fit the budget
        "variant": variant.name, "description": variant.title, "device": w.device,
        "dtype": dtype_name(w.dtype), "steps": n_steps, "warmup": n_warm, "status": "ok",
        "reason": "", "ms_per_step": None, "speedup_vs_fp32": None,
        "speedup_vs_torch_amp": None, "peak_memory_MiB": None, "final_loss": None,
        "pct_of_peak_matmul": None, "matmul_tflops": None, "flops_per_step": None,
        "world_size": w.world_size, "compile_s": None,
    }  # fmt: skip
    if member is None:
        reason = variant.available(w.device, w.dtype)[1]
        row.update(status="skipped", reason=reason)
        return row
    row.update(steps=len(member.times), warmup=len(member.warm))
    seconds = statistics.median(member.times)
    flops = w.flops_at(level)
    ref = peaks[variant.matmul_dtype(w.dtype)]
    row.update(
        ms_per_step=seconds * 1e3, peak_memory_MiB=member.peak_mib,
        final_loss=float(member.loss.item()) if member.loss is not None else None,
        flops_per_step=flops, matmul_tflops=flops / seconds / 1e12,
        pct_of_peak_matmul=100.0 * flops / seconds / ref.flops_per_s,
        peak_matmul_dtype=ref.name, device_peak_matmul_tflops=ref.flops_per_s / 1e12,
        compile_s=member.compile_s,
    )  # fmt: skip
    return row


def _speedups(block: list[dict[str, Any]]) -> None:
    by_name = {r["variant"]: r for r in block}
    for r in block:
        for ref_name, key in (("fp32", "speedup_vs_fp32"), ("torch.amp", "speedup_vs_torch_amp")):
            ref = by_name.get(ref_name)
            if ref is not None:
                r[key] = ref["ms_per_step"] / r["ms_per_step"]
