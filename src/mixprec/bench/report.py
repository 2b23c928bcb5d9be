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
import textwrap
from collections.abc import Sequence
from typing import Any

import torch

from mixprec._optional import require_matplotlib
from mixprec._version import __version__

__all__ = ["OutputError", "check_writable", "cpu_name", "figure", "metadata", "render_table",
           "require_matplotlib", "write_json", "write_plot"]  # fmt: skip


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


def _blocks(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows grouped by (workload, size), in the order they came."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["size"]), []).append(r)
    return list(groups.values())


def _sizes_sentence(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    budget, took = meta.get("budget_s"), meta.get("elapsed_s")
    reduced = list(dict.fromkeys(r["workload"] for r in rows
                                 if r.get("reduced") and r["status"] == "ok"))  # fmt: skip
    if budget is None:
        counts = ("the step counts asked for" if meta.get("steps_given")
                  else "the workloads' own step counts")  # fmt: skip
        why = meta.get("no_budget_reason")
        head = f"Sizes: the default ones, with {counts} (no time budget{': ' + why if why else ''})"
    else:
        took_text = f", took {took:.0f} s" if took is not None else ""
        outside = meta.get("outside_budget_s") or 0.0
        if outside and took is not None:
            took_text += (f" ({outside:.0f} s of it outside the budget: compiling TrainStep, "
                          f"reading memory events)")  # fmt: skip
        head = f"Sizes fitted to a {budget:g} s budget{took_text}"
    if not reduced:
        tail = "every workload at its default size."
    else:
        low_only = all(
            any(r["variant"] == "fp32" and not r.get("reduced") for r in rows if r["workload"] == w)
            for w in reduced
        )
        who = "the 16-bit rows of " if low_only else ""
        tail = (f"{who}{', '.join(reduced)} ran at reduced sizes (blocks marked \"reduced\", each "
                "with its own fp32 row, so every ratio compares equal sizes). --budget SECONDS "
                "allows more; --full runs the seeds' sizes.")  # fmt: skip
    return f"{head}: {tail}"


def _busy(meta: dict[str, Any]) -> bool:
    """Whether other processes shared the CPUs: load before the run above half of them, or
    after it above them all plus one (the run itself accounts for up to one per thread)."""
    before, after, cpus = (meta.get(k) for k in ("load_average_before", "load_average_after",
                                                  "cpu_count"))  # fmt: skip
    if before is None or after is None or not cpus:
        return False
    return before > cpus / 2 or after > cpus + 1


def render_table(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The benchmark table: what this machine can show, a legend, then one block per workload
    and size (speed-ups compare rows of one block), with the skipped variants' reasons."""
    wrap = textwrap.TextWrapper(width=100, subsequent_indent="  ")
    threads = meta.get("cpu_threads")
    world = meta.get("world_size", 1)
    ranks = f" | {world} ranks under DDP (this rank's timings)" if world > 1 else ""
    lines = [f"mixprec {meta['mixprec']} | torch {meta['torch']} | {meta['device_name']}{ranks}"
             + (f", {threads} thread{'s' * (threads != 1)}"
                if threads and rows and rows[0]["device"] == "cpu" else ""),
             ""]  # fmt: skip
    if meta.get("statement"):
        lines += wrap.wrap("What this machine can show: " + meta["statement"])
    lines += wrap.wrap(_sizes_sentence(rows, meta))
    if meta.get("malloc"):
        lines += wrap.wrap(f"--malloc keep: {meta['malloc']}.")
    if _busy(meta) and rows and rows[0]["device"] == "cpu":
        before, after = meta["load_average_before"], meta["load_average_after"]
        lines += wrap.wrap(
            f"This machine was busy while measuring (load average {before:.1f} before the run, "
            f"{after:.1f} after, on {meta['cpu_count']} CPUs): "
            "other processes slowed every step, so absolute times are high"
            + (" and the sizes fitted to the budget may be smaller than a quiet machine's"
               if meta.get("budget_s") and any(r.get("reduced") for r in rows) else "")
            + "; ratios within a block stay comparable, since its rows took turns.")  # fmt: skip
    lines += [
        "",
        "ms/step: median time of one training step (forward, loss, backward, optimizer).",
        "x fp32 / x torch.amp: speed-up over those rows of the same block (above 1 = faster).",
        "peak MiB: peak memory of a step ("
        + (
            "torch.profiler's CPU allocator events over one extra step, "
            "parameters and optimizer state included"
            if rows and rows[0]["device"] == "cpu"
            else "torch.cuda.max_memory_allocated"
        )
        + ").",
    ]
    compiled = [r for r in rows if r.get("compile_s")]
    if compiled:
        lines += wrap.wrap(
            "trainstep: the whole step compiled on a CPU (forward and loss under the policy, "
            "backward, update), a CUDA graph on CUDA; compiling took "
            + ", ".join(f"{r['compile_s']:.0f} s ({r['workload']})" for r in compiled)
            + ", before the timed steps (inductor caches it on disk for the next run)."
        )  # fmt: skip
    peaks = {k.removeprefix("peak_gflops_"): v for k, v in meta.items()
             if k.startswith("peak_gflops_")}  # fmt: skip
    if peaks:
        lines += wrap.wrap(
            "% peak: the step's matmul FLOP/s as a share of the best square-matmul rate measured "
            "at start-up in the row's matmul dtype (" + ", ".join(
                f"{k} {v:,.0f} GFLOP/s" for k, v in sorted(peaks.items())) + ").")  # fmt: skip
    if meta.get("interleaved"):
        lines += wrap.wrap("The variants of each block ran in turns, step by step, so that load "
                           "from other processes slows them alike.")  # fmt: skip
    over = False
    for block in _blocks(rows):
        first = block[0]
        ok = [r for r in block if r["status"] == "ok"]
        steps = (f"; {ok[0]['steps']} timed steps after {ok[0]['warmup']} warm-up"
                 if ok else "")  # fmt: skip
        mark = ", reduced" if first.get("reduced") else ""
        lines += ["", f"{first['workload']}{mark}  ({first['size']}{steps}; {first['dtype']}, "
                      f"{first['device']})"]  # fmt: skip
        lines.append(f"  {'variant':10s} {'ms/step':>9s} {'x fp32':>7s} {'x torch.amp':>12s} "
                     f"{'peak MiB':>9s} {'% peak':>7s} {'final loss':>11s}")  # fmt: skip
        for r in block:
            if r["status"] != "ok":
                lines.append(f"  {r['variant']:10s} skipped: {r['reason']}")
                continue
            pct = r["pct_of_peak_matmul"]
            star = pct is not None and pct > 100.0
            over = over or star
            lines.append(
                f"  {r['variant']:10s} {_fmt(r['ms_per_step'], 9, '.2f')} "
                f"{_fmt(r['speedup_vs_fp32'], 7, '.2f', 'x')} "
                f"{_fmt(r['speedup_vs_torch_amp'], 12, '.2f', 'x')} "
                f"{_fmt(r['peak_memory_MiB'], 9, '.0f')} "
                f"{_fmt(pct, 7 if not star else 6, '.1f', '%')}{'*' if star else ''} "
                f"{_fmt(r['final_loss'], 11, '.4f')}"
            )  # fmt: skip
        best = min(ok, key=lambda r: r["ms_per_step"], default=None)
        if best is not None and best.get("speedup_vs_fp32") and len(ok) > 1:
            lines.append(f"  fastest: {best['variant']} ({best['speedup_vs_fp32']:.2f}x fp32)")
    if over:
        lines += ["", *wrap.wrap(
            "* above 100%: these steps multiplied faster than any square product did at "
            "start-up (their shapes suit the kernels better, or other processes slowed the "
            "start-up measurement); read the peak as a lower bound for them.")]  # fmt: skip
    return "\n".join(lines)


def _title(meta: dict[str, Any], width_in: float, fontsize: float) -> str:
    """The figure's title, wrapped to the figure's width so that no side is clipped."""
    ratio = meta.get("low_vs_fp32_rate")
    rate = (f"; {meta['low_dtype']} matmuls at "
            + (f"{ratio:.1f}x" if ratio >= 0.5 else f"1/{1 / ratio:.0f} of")
            + " fp32's rate here" if ratio and meta.get("low_dtype") else "")  # fmt: skip
    busy = (f"; CPUs busy with other processes (load {meta['load_average_before']:.1f}): "
            f"times inflated" if _busy(meta) else "")  # fmt: skip
    text = (f"mixprec bench: {meta['device_name']}, torch {meta['torch']}{rate}{busy} "
            f"(bar labels: speed-up over fp32 at the same size)")  # fmt: skip
    chars = max(int(width_in * 72 / (fontsize * 0.6)), 20)  # an average glyph is ~0.6 em wide
    return "\n".join(textwrap.wrap(text, chars))


def figure(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> Any:
    """The bench figure (a matplotlib Figure): ms/step bars per variant, a panel per workload."""
    plt = require_matplotlib()
    # Per workload, the block with the 16-bit rows (the last): an fp32-only block at the default
    # size, beside a reduced one, is in the table.
    last = {b[0]["workload"]: b for b in _blocks(rows) if any(r["status"] == "ok" for r in b)}
    blocks = list(last.values())
    cols = min(len(blocks), 3) or 1
    nrows = -(-len(blocks) // cols) or 1
    width = max(4.5 * cols, 6.0)
    fig, axes = plt.subplots(nrows, cols, figsize=(width, 3.9 * nrows), squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, block in zip(axes.flat, blocks, strict=False):
        ok = [r for r in block if r["status"] == "ok"]
        names = [r["variant"] for r in ok]
        bars = ax.bar(names, [r["ms_per_step"] for r in ok],
                      color=["#888888" if n in ("fp32", "tf32") else "#d0883a" if n == "torch.amp"
                             else "#3a78d0" for n in names])  # fmt: skip
        for bar, r in zip(bars, ok, strict=True):
            if r.get("speedup_vs_fp32"):
                ax.annotate(f"{r['speedup_vs_fp32']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
        head = f"{ok[0]['workload']} ({ok[0]['dtype']})"
        size = textwrap.shorten(ok[0]["size"], 44, placeholder="...")
        ax.set_title(f"{head}\n{'reduced: ' if ok[0].get('reduced') else ''}{size}", fontsize=9)
        ax.set_ylabel("ms per step (lower is better)")
        ax.tick_params(axis="x", rotation=30)
        ax.margins(y=0.12)  # room for the labels above the bars
    for ax in list(axes.flat)[len(blocks) :]:
        ax.set_visible(False)
    fig.suptitle(_title(meta, width, 10), fontsize=10)
    return fig


def write_plot(path: str, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write `figure` as a PNG."""
    plt = require_matplotlib()
    fig = figure(rows, meta)
    fig.savefig(path, dpi=120)
    plt.close(fig)
