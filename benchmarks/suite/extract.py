"""Figures from what each part's command wrote: one ``extract_*(ctx, log) -> Figures`` per part.

Each reads the JSON (or pytest JUnit XML) the part's benchmark wrote into its work folder,
keeps the raw numbers, builds a table for the summary, names the figures the goals are judged
on (ratios are of ms/step or of peak MiB, so below 1 means "less than the reference"), says why
a figure is absent, and reports problems (failing tests, failed variants) that make the part
``failed`` while keeping its figures.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any

from suite.core import Context, Figures


def _load(ctx: Context, name: str) -> Any:
    with open(ctx.path(name)) as fh:
        return json.load(fh)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _junit(path: str) -> list[tuple[str, str, str]]:
    """(test id, passed|failed|error|skipped, message) per test case of a pytest JUnit file."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind and rank[kind] > rank[outcome]:
                outcome = kind
                message = child.get("message") or (child.text or "")
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append((name, outcome, " ".join(message.split())[:300]))
    return cases


def _pytest_figures(cases: list[tuple[str, str, str]], what: str) -> Figures:
    """Counts, failing tests (a problem each), skip reasons."""
    f = Figures()
    n = Counter(outcome for _, outcome, _ in cases)
    ran = n["passed"] + n["failed"] + n["error"]
    reasons = Counter(msg for _, outcome, msg in cases if outcome == "skipped")
    for key in ("passed", "failed", "error", "skipped"):
        f.put(key, n[key])
    f.put(f"{what} failing", n["failed"] + n["error"] if ran else None,
          "none ran: " + "; ".join(reasons) if reasons else "no test was collected")  # fmt: skip
    f.put("skip reasons", dict(reasons.most_common(5)) or None, "no test skipped")
    bad = [(name, outcome, msg) for name, outcome, msg in cases if outcome in ("failed", "error")]
    f.table = [{"test": name.split("::", 1)[-1], "outcome": outcome, "message": msg}
               for name, outcome, msg in bad[:30]]  # fmt: skip
    if bad:
        f.problems.append(
            f"{len(bad)} {what} failed: "
            + ", ".join(name.split("::", 1)[-1] for name, _, _ in bad[:5])
        )
    return f


def _peak_ratios(f: Figures, rows: dict[str, dict], pairs: dict[str, str], key: str,
                 label: str) -> None:  # fmt: skip
    """The largest peak-memory ratio of a mixprec row to its torch.amp row, and which row."""
    ratios = {}
    for mine, ref in pairs.items():
        a, b = rows.get(mine, {}).get(key), rows.get(ref, {}).get(key)
        if a is not None and b is not None:
            ratios[mine] = a / b
    if not ratios:
        why = ("peak memory is measured on CUDA only" if all(r.get(key) is None for r in
               rows.values()) else "no pair of rows ran")  # fmt: skip
        f.put(label, None, why)
        f.put("worst peak row", None, why)
        return
    worst = max(ratios, key=ratios.__getitem__)
    f.put(label, ratios[worst])
    f.put("worst peak row", f"{worst} vs {pairs[worst]}")


# ------------------------------------------------------------------- a, b: CUDA tests


def extract_cuda_tests(ctx: Context, log: str) -> Figures:
    f = _pytest_figures(_junit(ctx.path("a.xml")), "CUDA tests")
    summary = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|skipped|failed)", ln)]
    f.put("pytest summary", summary[-1].strip("= ") if summary else None, "no summary line")
    return f


#: CUDA-list entries that a CPU build cannot run (no cuDNN, no fake kernel): the GPU's news.
CPU_GAPS = ("cudnn_convolution", "cudnn_convolution_transpose", "gru_cell", "grid_sampler",
            "equal")  # fmt: skip


def extract_autocast_lists(ctx: Context, log: str) -> Figures:
    cases = _junit(ctx.path("b.xml"))
    f = _pytest_figures(cases, "list entries")
    for dt in ("fp16", "bf16"):
        mine = [o for name, o, _ in cases if f"[{dt}-" in name]
        ran = [o for o in mine if o != "skipped"]
        f.put(f"{dt} entries passed", len([o for o in ran if o == "passed"]))
        f.put(f"{dt} entries failing", len(ran) - ran.count("passed") if ran else None,
              f"no {dt} entry ran")  # fmt: skip
    gaps = {name.split("[", 1)[-1].rstrip("]"): o for name, o, _ in cases
            if name.rstrip("]").rsplit(":", 1)[-1] in CPU_GAPS}  # fmt: skip
    f.put(
        "entries a CPU build cannot run, on this device",
        gaps or None,
        "none of them ran here" if ctx.device == "cuda" else "they run on a GPU only",
    )
    return f


# ---------------------------------------------------------------------- c: no syncs


def extract_no_sync(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "c.json")
    f = Figures(raw=doc)
    rows = doc["rows"]
    f.table = [{"configuration": r["kind"], "status": r["status"],
                "syncs/step": r.get("syncs_per_step"), "expected": r.get("expected_syncs_per_step"),
                "skipped updates": r.get("skipped_updates"), "error mode": r.get("error_mode"),
                "captured": r.get("captured"), "note": r.get("reason") or ""}
               for r in rows]  # fmt: skip
    free = [r for r in rows if r.get("expected_syncs_per_step") == 0 and r["status"] == "ok"]
    counted = [r["syncs_per_step"] for r in free if r.get("syncs_per_step") is not None]
    why = rows[0].get("why_no_count", "no configuration counted") if rows else "no rows"
    f.put("max syncs/step (sync-free configurations)", max(counted) if counted else None, why)
    for r in rows:
        f.put(f"{r['kind']} syncs/step", r.get("syncs_per_step"),
              r.get("why_no_count") or r.get("reason") or "not counted")  # fmt: skip
    f.problems += [f"{r['kind']}: {r['reason']}" for r in rows if r["status"] != "ok"]
    # The two checks must agree: a step that raised under "error" had a sync "warn" must count.
    raised = [r["kind"] for r in rows if str(r.get("error_mode", "")).startswith("raised")]
    f.put("error mode raised in", raised or "none")
    f.problems += [f"{r['kind']}: the error-mode step raised but 'warn' counted no sync; "
                   f"the count is wrong" for r in rows
                   if r["kind"] in raised and r.get("syncs_per_step") == 0]  # fmt: skip
    return f


# -------------------------------------------------------------- d: whole-step capture

_GRAPH_PEAK_PAIRS = {
    "O1 eager fp16": "torch.amp fp16", "O1 eager bf16": "torch.amp bf16",
    "TrainStep O1 fp16": "torch.amp fp16", "TrainStep O1 bf16": "torch.amp bf16",
    "TrainStep O2 fp16": "torch.amp fp16", "TrainStep O1 fp16 any-opt": "torch.amp fp16",
    "TrainStep O1 bf16+compile": "torch.amp+compile bf16",
}  # fmt: skip
_GRAPH_RATIOS = (  # (figure, row, reference row): ms/step ratios, below 1 = the row is faster
    ("TrainStep O1 fp16 / manual fp16", "TrainStep O1 fp16", "manual fp16"),
    ("TrainStep O1 bf16 / manual bf16", "TrainStep O1 bf16", "manual bf16"),
    ("TrainStep O1 fp16 / fp32 eager", "TrainStep O1 fp16", "fp32"),
    ("TrainStep O1 bf16 / fp32 eager", "TrainStep O1 bf16", "fp32"),
    ("TrainStep O1 fp16 / torch.amp fp16", "TrainStep O1 fp16", "torch.amp fp16"),
    ("O1 eager fp16 / torch.amp fp16", "O1 eager fp16", "torch.amp fp16"),
    ("TrainStep O1 bf16+compile / torch.amp+compile bf16", "TrainStep O1 bf16+compile",
     "torch.amp+compile bf16"),
)  # fmt: skip


def extract_graph_step(ctx: Context, log: str, name: str) -> Figures:
    rows = _load(ctx, f"{name}.json")
    f = Figures(raw=rows)
    by = {r["variant"]: r for r in rows}
    ok = {v: r for v, r in by.items() if r["status"] == "ok"}
    f.table = [{"variant": r["variant"], "ms/step": r.get("ms_per_step"),
                "x fp32": r.get("x_fp32"), "x torch.amp": r.get("x_torch_amp"),
                "x manual": r.get("x_manual"), "peak MiB": r.get("peak_MiB"),
                "reserved MiB": r.get("reserved_MiB"), "held before MiB": r.get("held_before_MiB"),
                "captured": r.get("captured"),
                "status": r["status"] + (f": {r['reason']}" if r["status"] != "ok" else "")}
               for r in rows]  # fmt: skip
    for figure, mine, ref in _GRAPH_RATIOS:
        a, b = ok.get(mine, {}).get("ms_per_step"), ok.get(ref, {}).get("ms_per_step")
        missing = [v for v in (mine, ref) if v not in ok]
        why = "; ".join(f"{v}: {by[v]['status']}: {by[v]['reason']}" if v in by else
                        f"{v}: not run" for v in missing)  # fmt: skip
        f.put(figure, _ratio(a, b), why)
    _peak_ratios(f, ok, _GRAPH_PEAK_PAIRS, "peak_MiB", "max peak / torch.amp peak")
    if ctx.device == "cuda":
        eager = {v: r.get("reason", "") for v, r in ok.items()
                 if v.startswith("TrainStep") and r.get("captured") is False}  # fmt: skip
        f.put("TrainStep rows not captured", eager or "none")
    f.problems += [f"{r['variant']} failed: {r['reason']}" for r in rows
                   if r["status"] == "failed"]  # fmt: skip
    return f


# --------------------------------------------------------------- e: scaler, autocast


def extract_scaler(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "e-scaler.json")
    f = Figures(raw=doc)
    by = {r["variant"]: r for r in doc["rows"]}
    f.table = [{"workload": r["workload"], "variant": r["variant"],
                "ms": r.get("ms_per_iteration", r.get("ms")),
                "step+update host ms": r.get("step_update_host_ms"),
                "x torch": r.get("step_update_speedup_vs_torch", r.get("throughput_vs_torch")),
                "GB/s": r.get("GB_per_s")} for r in doc["rows"]]  # fmt: skip
    default, sync = by["mixprec.GradScaler"], by["mixprec.GradScaler(skip_mode='sync')"]
    f.put(
        "step+update speed-up vs torch (mixprec default)", default["step_update_speedup_vs_torch"]
    )
    f.put("step+update speed-up vs torch (skip_mode='sync')", sync["step_update_speedup_vs_torch"])
    f.put("iteration speed-up vs torch (mixprec default)", default["iteration_speedup_vs_torch"])
    fused, foreach = (by["mixprec unscale_ (fused kernel, default)"],
                      by["mixprec unscale_ (foreach)"])  # fmt: skip
    f.put("unscale throughput vs torch (default)", fused["throughput_vs_torch"])
    f.put("unscale throughput vs torch (foreach)", foreach["throughput_vs_torch"])
    f.put("unscale GB/s (default)", fused["GB_per_s"])
    sizes = re.search(r"unscale (\d+) x (\d+)", fused["workload"])
    f.put("unscale elements", int(sizes[1]) * int(sizes[2]) if sizes else None, "size unknown")
    return f


def extract_autocast(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "e-autocast.json")
    f = Figures(raw=doc)
    res = next(r for r in doc["results"] if r["workload"] == "gpu-bound")
    by = {r["variant"]: r for r in res["rows"]}
    f.table = [{"variant": r["variant"], "ms/step": r["ms_per_step"],
                "ratio": r["ratio_vs_torch_autocast"], "q25": r["ratio_q25"],
                "q75": r["ratio_q75"]} for r in res["rows"]]  # fmt: skip
    mine = by["mixprec.autocast"]
    f.put("size", f"{res['size']}, {res['device']}, {res['rounds']} rounds")
    f.put("mixprec / torch.autocast (gpu-bound)", mine["ratio_vs_torch_autocast"])
    f.put("IQR", [mine["ratio_q25"], mine["ratio_q75"]])
    f.put(
        "no weight cache / torch.autocast",
        by["mixprec.autocast (no weight cache)"]["ratio_vs_torch_autocast"],
    )
    f.put(
        "empty mode floor / torch.autocast",
        by["torch.autocast + empty mode (floor)"]["ratio_vs_torch_autocast"],
    )
    f.put("torch.autocast ms/step", by["torch.autocast"]["ms_per_step"])
    return f


# ------------------------------------------------------------------ i: graph-level AMP


def extract_graph_amp(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "i-graph-amp.json")
    f = Figures(raw=doc)
    f.table = doc["rows"]
    f.put("backend", f"{doc.get('backend', '?')}, {doc['device']}, {doc['rounds']} rounds")
    for r in doc["rows"]:
        if r["variant"].startswith("mixprec.compile"):
            key = f"{r['variant']} / torch.autocast+compile ({r['workload']})"
            f.put(key, r["ratio_to_torch_compile"])
            f.put(
                f"{r['variant']} casts ({r['workload']})",
                f"{r['casts_recorded']} -> {r['casts_after_pass']} (eager {r['eager_casts']})",
            )
    return f


# ------------------------------------------------------------------ j, k: distributed


def extract_ddp(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "j-ddp.json")
    f = Figures(raw=doc)
    f.table = [{k: r.get(k) for k in ("level", "dtype", "rank", "world_size", "eager_ms",
                                        "captured_ms", "speedup", "first_captured_call",
                                        "agrees_with_eager")} for r in doc]  # fmt: skip
    # every record carries the run's whole list of failed checks: count it once
    f.put("failed checks", len(doc[0].get("failed") or []) if doc else None)
    for r in doc:
        if r.get("rank") == 0:
            f.put(
                f"{r['level']} {r['dtype']} captured / eager",
                _ratio(r.get("captured_ms"), r.get("eager_ms")),
            )
    return f


def extract_fsdp_memory(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "k-fsdp.json")
    f = Figures(raw=doc)
    f.table = doc
    rank0 = {r["config"]: r for r in doc if r.get("rank") == 0}
    o2, mp = rank0.get("mixprec O2"), rank0.get("fsdp2 mp")
    f.put(
        "O2 total - FSDP2 policy total (bytes)",
        None if not (o2 and mp) else o2["total"] - mp["total"],
    )
    for name, r in rank0.items():
        f.put(f"{name} peak MiB", r.get("peak_MiB"), "memory peaks are measured on CUDA only")
    return f


# ------------------------------------------------------------------ l: FP8


def extract_fp8(ctx: Context, log: str, name: str, part: str) -> Figures:
    doc = _load(ctx, f"{name}.json")
    f = Figures(raw=doc)
    f.table = doc.get(part) or []
    g = doc.get("goals", {})
    if part == "gemm":
        f.put("FP8 GEMM speed-up, large shapes (min)", g.get("gemm_speedup_large_min"))
    elif part == "step":
        best = g.get("medium_step_best") or {}
        f.put(
            "GPT-2 medium FP8 TrainStep / bf16 TrainStep speed-up",
            best.get("speedup_vs_bf16_trainstep"),
        )
        f.put("best FP8 variant", best.get("variant"))
    else:
        f.put("FP8 recipes outside bf16 loss spread", g.get("loss_outside_spread"))
        f.put(
            "bf16 final loss (mean, spread)",
            [g.get("bf16_final_loss_mean"), g.get("bf16_final_loss_spread")],
        )
    return f


# ------------------------------------------------------------------ f: opt levels


def extract_opt_levels(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "f.json")
    f = Figures(raw=doc)
    by = {r["variant"]: r for r in doc["rows"]}
    f.table = doc["rows"]
    f.put("model", f"{doc['meta'].get('model', '?')}, batch {doc['meta'].get('batch', '?')}, "
          f"{doc['meta'].get('dtype', '?')}")  # fmt: skip
    cuda_only = "memory is measured on CUDA only"
    o1, o2 = by["mixprec O1"], by["mixprec O2"]
    f.put("O2 peak / O1 peak", _ratio(o2.get("peak_MiB"), o1.get("peak_MiB")), cuda_only)
    f.put(
        "O2 activations / O1 activations",
        _ratio(o2.get("activation_peak_MiB"), o1.get("activation_peak_MiB")),
        cuda_only,
    )
    _peak_ratios(f, by, {f"mixprec {lv}": "torch.amp" for lv in ("O1", "O2", "O3")},
                 "peak_MiB", "max peak / torch.amp peak")  # fmt: skip
    for lv in ("O0", "O1", "O2", "O3"):
        f.put(f"{lv} time / torch.amp", _ratio(by[f"mixprec {lv}"]["ms_per_step"],
                                               by["torch.amp"]["ms_per_step"]))  # fmt: skip
    return f


# ------------------------------------------------------------------ g: diagnostics


def extract_watch(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "g-watch.json")
    f = Figures(raw=doc)
    f.table = [{"workload": r["workload"], "size": r["size"], "variant": r["variant"],
                "ms/step": r["ms_per_step"], "x no watch": r["ratio"]}
               for r in doc["rows"]]  # fmt: skip
    for r in doc["rows"]:
        if r["variant"] != "no watch":
            f.put(f"{r['workload']} {r['variant']} / no watch", r["ratio"])
    f.put("watched steps ran under sync debug mode 'error'", ctx.device == "cuda")
    return f


def extract_nan(ctx: Context, log: str) -> Figures:
    doc = _load(ctx, "g-nan.json")
    f = Figures(raw=doc)
    f.table = [{k: v for k, v in r.items() if k != "summary"} for r in doc["results"]]
    for r in doc["results"]:
        dt = r["dtype"]
        f.put(f"{dt} first non-finite loss step", r["first_nonfinite_loss_step"], "none")
        f.put(f"{dt} non-finite losses", r["nonfinite_loss_steps"])
        f.put(f"{dt} skipped updates", r["skipped_updates"])
        f.put(f"{dt} first event", r["first_event"], "no inf/NaN seen")
    return f


# ---------------------------------------------------------------------- h: bench


def extract_bench(ctx: Context, log: str) -> Figures:
    rows = _load(ctx, "h.json")
    f = Figures(raw=rows)
    f.table = [{"workload": r["workload"], "variant": r["variant"], "dtype": r["dtype"],
                "ms/step": r["ms_per_step"], "x fp32": r["speedup_vs_fp32"],
                "x torch.amp": r["speedup_vs_torch_amp"], "peak MiB": r["peak_memory_MiB"],
                "% peak": r["pct_of_peak_matmul"],
                "status": r["status"] + (f": {r['reason']}" if r["status"] != "ok" else "")}
               for r in rows]  # fmt: skip
    ratios, worst = {}, None
    for r in rows:
        if r["status"] == "ok" and r["variant"] in ("O1", "O2", "O3", "trainstep"):
            f.put(f"{r['workload']} {r['variant']} x torch.amp", r["speedup_vs_torch_amp"])
    for w in dict.fromkeys(r["workload"] for r in rows):
        ok = {r["variant"]: r for r in rows if r["workload"] == w and r["status"] == "ok"}
        ref = ok.get("torch.amp", {}).get("peak_memory_MiB")
        for v in ("O1", "O2", "O3", "trainstep"):
            mine = ok.get(v, {}).get("peak_memory_MiB")
            if ref and mine is not None:
                ratios[f"{w} {v}"] = mine / ref
    if ratios:
        worst = max(ratios, key=ratios.__getitem__)
    f.put("max peak / torch.amp peak", ratios[worst] if worst else None,
          "peak memory is measured on CUDA only")  # fmt: skip
    f.put("worst peak row", worst, "peak memory is measured on CUDA only")
    return f
