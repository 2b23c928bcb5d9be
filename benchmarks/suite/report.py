"""The suite's outputs: the markdown summary, and the logs packed into one archive.

The summary puts every goal of every registered part beside its figure with a verdict (MET,
MISSED, NOT MEASURED with the reason, or NOT JUDGED: a GPU goal on a CPU run, or a goal that
needs a capability the machine lacks), then the parts with their
status and time, each part's figures, and for every part that did not finish ``ok`` its reason
and the tail of its log.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Sequence
from typing import Any

from suite.core import Part

VERDICTS = ("MET", "MISSED", "NOT MEASURED", "NOT JUDGED")


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def fmt(value: Any) -> str:
    """A figure for a table cell: short, no pipes or newlines."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        value = json.dumps(_rounded(value), default=str)
    text = str(value).replace("|", "/").replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def _calls(doc: dict[str, Any]) -> list[str]:
    calls = doc["calls"]
    lines = []
    devices = list(dict.fromkeys(c.get("device_name", "?") for c in calls))
    if len(devices) > 1:
        lines.append(f"**The calls ran on different devices ({', '.join(devices)}): compare "
                     "timings only within one device.**")  # fmt: skip
    for i, c in enumerate(calls, 1):
        lines.append(
            f"- call {i}: {c.get('started', '?')}, {fmt(c.get('duration_s'))} s, "
            f"{c.get('device_name', '?')}; torch {c.get('torch', '?')}, CUDA "
            f"{c.get('cuda') or 'none'}, Python {c.get('python', '?')}, mixprec "
            f"{c.get('mixprec', '?')}, commit {c.get('git_commit', 'unknown')}; parts: "
            f"{', '.join(c.get('parts_run', [])) or 'none'}"
            + (f"; wheels: {', '.join(c['wheels'])}" if c.get("wheels") else "")
        )
        lines.append(f"  `{c.get('command', '')}`")
    return lines


def render_summary(doc: dict[str, Any], parts: Sequence[Part], title: str = "GPU suite",
                   smoke_note: str = "GPU goals are NOT JUDGED") -> str:  # fmt: skip
    """The markdown summary of a results document (one call's, or several merged)."""
    calls = doc["calls"]
    records = doc["parts"]
    smoke = any(c.get("mode") == "smoke" for c in calls)
    device = calls[-1].get("device_name", "?") if calls else "?"
    lines = [f"# mixprec {title}: {device}", ""]
    if smoke:
        lines += [f"**Smoke run: toy sizes on the CPU. The figures test the suite's machinery, "
                  f"not mixprec's claims; {smoke_note}.**", ""]  # fmt: skip
    lines += _calls(doc)
    known = {p.name for p in parts}
    ordered = sorted(parts, key=lambda p: p.priority)
    # Parts of an older or newer registry than this one still get reported.
    extra = [r for n, r in records.items() if n not in known]

    lines += ["", "## Goals", "",
              "| goal | part | figure | value | target | verdict | note |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    counts = dict.fromkeys(VERDICTS, 0)
    for p in ordered:
        rec = records.get(p.name)
        judged = rec["goals"] if rec else [
            g.judge(None, "", "part not run in these calls") for g in p.goals]  # fmt: skip
        for g in judged:
            counts[g["verdict"]] = counts.get(g["verdict"], 0) + 1
            verdict = f"**{g['verdict']}**" if g["verdict"] == "MISSED" else g["verdict"]
            note = "" if g["verdict"] in ("MET", "MISSED") else g.get("detail", "")
            lines.append(f"| {g['goal']} | {p.name} | {g['figure']} | {fmt(g['value'])} | "
                         f"{g['op']} {fmt(g['target'])} | {verdict} | {fmt(note)} |")  # fmt: skip
    lines += ["", ", ".join(f"{k} {v}" for k, v in counts.items())]

    lines += ["", "## Parts", "", "| part | what | status | seconds | note |",
              "|---|---|---|---|---|"]  # fmt: skip
    for p in ordered:
        rec = records.get(p.name)
        if rec is None:
            lines.append(f"| {p.name} | {p.title} | not run | - | not selected in these calls |")
            continue
        lines.append(f"| {p.name} | {p.title} | {rec['status']} | {fmt(rec['duration_s'])} | "
                     f"{fmt(rec['reason'])} |")  # fmt: skip
    for rec in extra:
        lines.append(f"| {rec['part']} | {rec['title']} | {rec['status']} | "
                     f"{fmt(rec['duration_s'])} | {fmt(rec['reason'])} |")  # fmt: skip

    lines += ["", "## Figures"]
    for rec in [records[p.name] for p in ordered if p.name in records] + extra:
        if not rec["figures"] and not rec["table"]:
            continue
        lines += ["", f"### {rec['part']}: {rec['title']}", "", f"`{rec['command']}`", ""]
        lines += _table(rec["table"])
        if rec["table"]:
            lines.append("")
        lines += ["| figure | value |", "|---|---|"]
        for key, value in rec["figures"].items():
            why = rec["unmeasured"].get(key) if value is None else None
            lines.append(f"| {key} | {fmt(value) if why is None else '- (' + fmt(why) + ')'} |")

    bad = [r for r in [records[p.name] for p in ordered if p.name in records] + extra
           if r["status"] != "ok"]  # fmt: skip
    if bad:
        lines += ["", "## Failures and skips"]
        for rec in bad:
            lines += ["", f"### {rec['part']}: {rec['status']}", "", rec["reason"] or "-"]
            if rec.get("error_tail"):
                lines += ["", "```", rec["error_tail"], "```"]
    return "\n".join(lines) + "\n"


def pack_logs(work_root: str, out_path: str) -> None:
    """Every part's log and raw output under `work_root`, as one .tar.gz (written atomically)."""
    tmp = out_path + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for name in sorted(os.listdir(work_root)):
            tar.add(os.path.join(work_root, name), arcname=name)
    os.replace(tmp, out_path)
