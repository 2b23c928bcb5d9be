"""Benchmark output: a table people can read, JSON pandas can read, a PNG where a picture helps.

JSON is a list of flat records (``pandas.read_json(path)`` gives one row per record); every
record repeats the run's metadata (command, versions, device), so files from several machines
concatenate into one table.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch

from mixprec._version import __version__

__all__ = ["check_writable", "cpu_name", "metadata", "render_table", "require_matplotlib",
           "write_json", "write_plot"]  # fmt: skip


class OutputError(Exception):
    """An output path that cannot be written (reported before any work is done)."""


def check_writable(path: str, what: str) -> None:
    """Fail now, not after minutes of work, if `path` cannot be written."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise OutputError(f"{what} path {path!r} is a directory; give a file name.")
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        raise OutputError(
            f"{what} path {path!r}: the folder {folder!r} does not exist; create it first."
        )
    if not os.access(folder, os.W_OK) or (
        os.path.exists(target) and not os.access(target, os.W_OK)
    ):
        raise OutputError(f"{what} path {path!r} is not writable.")


def require_matplotlib() -> Any:
    """matplotlib with a headless backend, or a clear error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise OutputError(
            "plotting needs matplotlib: pip install 'mixprec[plots]' (or pip install matplotlib)."
        ) from err
    return plt


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), for result metadata."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def metadata(device: str) -> dict[str, Any]:
    """What produced a result: command, versions, device."""
    return {
        "command": " ".join(["mixprec", *sys.argv[1:]]),
        "mixprec": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }


def write_json(path: str, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """A list of records, each with the run's metadata."""
    with open(path, "w") as fh:
        json.dump([{**meta, **row} for row in rows], fh, indent=1)


def _fmt(value: Any, width: int, spec: str, suffix: str = "") -> str:
    text = "-" if value is None else f"{value:{spec}}{suffix}"
    return f"{text:>{width}s}"


def render_table(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The benchmark table, grouped by workload, with a legend and the skipped variants' reasons."""
    world = meta.get("world_size", 1)
    ranks = f" | {world} ranks under DDP (this rank's timings)" if world > 1 else ""
    lines = [
        f"mixprec {meta['mixprec']} | torch {meta['torch']} | {meta['device_name']}{ranks}",
        "",
        "ms/step: median time of one training step (forward, loss, backward, optimizer).",
        "x fp32 / x torch.amp: speed-up over those rows (above 1 = faster).",
        "peak MiB: peak GPU memory of a step.  % peak: share of this device's measured matmul "
        "rate.",
    ]
    peaks = {r["peak_matmul_dtype"]: r["device_peak_matmul_tflops"]
             for r in rows if r.get("peak_matmul_dtype")}  # fmt: skip
    if peaks:
        lines.append("this device's matmul peak, measured now: " + ", ".join(
            f"{k} {v * 1e3:.0f} GFLOP/s" if v < 1 else f"{k} {v:.0f} TFLOP/s"
            for k, v in peaks.items()))  # fmt: skip
        low = [v for k, v in peaks.items() if k in ("bf16", "fp16")]
        if low and "fp32" in peaks and max(low) < peaks["fp32"]:
            lines.append("  (16-bit matmuls are slower than fp32 here: this CPU lacks fast bf16/"
                         "fp16 instructions, so mixed precision cannot speed it up)")  # fmt: skip
    workloads: list[str] = []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    for w in workloads:
        block = [r for r in rows if r["workload"] == w]
        lines += ["", f"{w}  ({block[0]['size']}, {block[0]['dtype']}, {block[0]['device']})"]
        lines.append(f"  {'variant':10s} {'ms/step':>9s} {'x fp32':>7s} {'x torch.amp':>12s} "
                     f"{'peak MiB':>9s} {'% peak':>7s} {'final loss':>11s}")  # fmt: skip
        for r in block:
            if r["status"] != "ok":
                lines.append(f"  {r['variant']:10s} skipped: {r['reason']}")
                continue
            lines.append(
                f"  {r['variant']:10s} {_fmt(r['ms_per_step'], 9, '.2f')} "
                f"{_fmt(r['speedup_vs_fp32'], 7, '.2f', 'x')} "
                f"{_fmt(r['speedup_vs_torch_amp'], 12, '.2f', 'x')} "
                f"{_fmt(r['peak_memory_MiB'], 9, '.0f')} "
                f"{_fmt(r['pct_of_peak_matmul'], 7, '.1f', '%')} "
                f"{_fmt(r['final_loss'], 11, '.4f')}"
            )  # fmt: skip
        best = min((r for r in block if r["status"] == "ok"), key=lambda r: r["ms_per_step"],
                   default=None)  # fmt: skip
        if best is not None and best.get("speedup_vs_fp32"):
            lines.append(f"  fastest: {best['variant']} ({best['speedup_vs_fp32']:.2f}x fp32)")
    return "\n".join(lines)


def write_plot(path: str, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Bars of ms/step per variant, one panel per workload, speed-up over fp32 on each bar."""
    plt = require_matplotlib()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.8), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        block = [r for r in rows if r["workload"] == w and r["status"] == "ok"]
        names = [r["variant"] for r in block]
        values = [r["ms_per_step"] for r in block]
        bars = ax.bar(names, values, color=["#888888" if n in ("fp32", "tf32") else
                                            "#d0883a" if n == "torch.amp" else "#3a78d0"
                                            for n in names])  # fmt: skip
        for bar, r in zip(bars, block, strict=True):
            if r.get("speedup_vs_fp32"):
                ax.annotate(f"{r['speedup_vs_fp32']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_title(f"{w} ({block[0]['dtype'] if block else ''})")
        ax.set_ylabel("ms per step (lower is better)")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"mixprec bench: {meta['device_name']}, torch {meta['torch']} "
                 f"(labels: speed-up over fp32)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
