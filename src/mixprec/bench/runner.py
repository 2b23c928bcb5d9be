"""Run workloads x variants side by side and collect one row per pair.

Per row: the median of the per-step times after warm-up (each step synchronized), peak memory
(CUDA), the final loss, and the share of the device's peak matmul rate, where the peak is
measured in the same run (a large square matmul per dtype) and the step's matmul FLOPs are
counted by ``torch.utils.flop_counter``. Speed-ups are computed against the fp32 and torch.amp
rows of the same run.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec.bench.variants import VARIANTS, Variant
from mixprec.bench.workloads import WORKLOADS, Workload, WorkloadSize
from mixprec.dtypes import dtype_name

__all__ = ["measure_peak", "run"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_peak(device: str, name: str) -> float:
    """FLOP/s of a large square matmul in `name` (``fp32``, ``tf32``, ``bf16``, ``fp16``)."""
    n = 8192 if device == "cuda" else 1024
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
             "fp16": torch.float16}[name]  # fmt: skip
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        times = []
        for i in range(4):
            _sync(device)
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            if i:  # the first is warm-up
                times.append(time.perf_counter() - t0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * n**3 / statistics.median(times)


def _flops(workload: Workload, size: WorkloadSize, device: str) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, batch = workload.build(size.params, device)
    counter = FlopCounterMode(display=False)
    with counter:
        workload.loss(model(batch[0]), batch).backward()
    del model
    return float(counter.get_total_flops())


def _time(step: Callable[[], torch.Tensor], size: WorkloadSize, device: str):
    for _ in range(size.warmup):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    loss = None
    for _ in range(size.steps):
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return statistics.median(times), peak, float(loss.item()) if loss is not None else None


def run(
    workloads: Iterable[str],
    variants: Iterable[str],
    *,
    device: str,
    dtype: torch.dtype,
    full: bool,
    steps: int | None = None,
    warmup: int | None = None,
    progress: Callable[[str], None] | None = None,
    dist: Any = None,
) -> list[dict[str, Any]]:
    """Run every (workload, variant) pair; return one row each (skipped ones with a reason).

    `dist` (a `mixprec.distributed.launch.DistContext`) runs every variant data-parallel under
    DDP on each rank, with the workload's batch per rank; the rows are this rank's timings.
    """
    world = 1 if dist is None else dist.world_size
    rows: list[dict[str, Any]] = []
    peaks: dict[str, float] = {}
    for wname in workloads:
        workload = WORKLOADS[wname]
        size = workload.size(full, device)
        if steps is not None or warmup is not None:
            size = WorkloadSize(size.description, steps or size.steps,
                                size.warmup if warmup is None else warmup, size.params)  # fmt: skip
        flops = _flops(workload, size, device)
        block: list[dict[str, Any]] = []
        for vname in variants:
            variant: Variant = VARIANTS[vname]
            if progress is not None:
                progress(f"{wname} / {vname}")
            row: dict[str, Any] = {
                "workload": wname, "size": size.description, "variant": vname,
                "description": variant.title, "device": device, "dtype": dtype_name(dtype),
                "steps": size.steps, "warmup": size.warmup, "status": "ok", "reason": "",
                "ms_per_step": None, "speedup_vs_fp32": None, "speedup_vs_torch_amp": None,
                "peak_memory_MiB": None, "final_loss": None, "pct_of_peak_matmul": None,
                "matmul_tflops": None, "world_size": world,
            }  # fmt: skip
            ok, reason = variant.available(device, dtype)
            if not ok:
                row.update(status="skipped", reason=reason)
                block.append(row)
                continue
            step, cleanup = variant.build(workload, size, device, dtype, dist=dist)
            try:
                seconds, peak, loss = _time(step, size, device)
            finally:
                cleanup()
                del step
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            ref = variant.matmul_dtype(dtype)
            if ref not in peaks:
                peaks[ref] = measure_peak(device, ref)
            row.update(
                ms_per_step=seconds * 1e3, peak_memory_MiB=peak, final_loss=loss,
                matmul_tflops=flops / seconds / 1e12,
                pct_of_peak_matmul=100.0 * flops / seconds / peaks[ref],
                peak_matmul_dtype=ref, device_peak_matmul_tflops=peaks[ref] / 1e12,
            )  # fmt: skip
            block.append(row)
        by_name = {r["variant"]: r for r in block if r["status"] == "ok"}
        for r in block:
            if r["status"] != "ok":
                continue
            for ref_name, key in (
                ("fp32", "speedup_vs_fp32"),
                ("torch.amp", "speedup_vs_torch_amp"),
            ):
                ref_row = by_name.get(ref_name)
                if ref_row is not None:
                    r[key] = ref_row["ms_per_step"] / r["ms_per_step"]
        rows.extend(block)
    return rows
