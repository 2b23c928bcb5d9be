"""benchmarks/gpu_suite.py: every part runs in smoke mode, and the suite survives failures.

The smoke run (every registered part at toy sizes on the CPU, ~1 minute on 2 cores) is what
keeps the GPU suite from rotting between GPU sessions: a part that fails here would fail there.
The failure handling is checked on injected parts (a crash, a hang with a child process, an
unreadable output, a missing module, an exhausted budget, a SIGTERM), never by breaking a real
part.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def _load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for its `suite` package
    return module


gpu_suite = _load_suite()
from suite import core, env  # noqa: E402  (benchmarks/suite, importable after the load)

VERDICTS = {"MET", "MISSED", "NOT MEASURED", "NOT JUDGED"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    work = tmp_path_factory.mktemp("work")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SUITE), "--smoke", "--out", str(out),
                           "--workdir", str(work)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)  # fmt: skip
    seconds = time.monotonic() - t0
    doc = json.loads((out / "results.json").read_text())
    return {"proc": proc, "out": out, "work": work, "doc": doc, "seconds": seconds,
            "summary": (out / "summary.md").read_text()}  # fmt: skip


def _problems(doc) -> str:
    return "\n".join(f"{r['part']}: {r['status']}: {r['reason']}\n{r['error_tail']}"
                     for r in doc["parts"].values() if r["status"] != "ok")  # fmt: skip


@pytest.mark.slow
def test_smoke_runs_every_registered_part_ok(smoke):
    doc, proc = smoke["doc"], smoke["proc"]
    assert proc.returncode == 0, _problems(doc) + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert list(doc["parts"]) == [p.name for p in sorted(gpu_suite.PARTS,
                                                          key=lambda p: p.priority)]  # fmt: skip
    assert all(r["status"] == "ok" for r in doc["parts"].values()), _problems(doc)
    (call,) = doc["calls"]
    assert call["mode"] == "smoke" and call["device"] == "cpu"
    assert call["launcher"].startswith("forked from one server that imported torch")
    assert call["parts_run"] == list(doc["parts"])
    print(f"smoke run: {smoke['seconds']:.0f} s")  # shown with -s; the budget is 2 minutes


@pytest.mark.slow
def test_each_record_has_the_schema(smoke):
    parts = {p.name: p for p in gpu_suite.PARTS}
    for name, rec in smoke["doc"]["parts"].items():
        part = parts[name]
        assert rec["part"] == name and rec["title"] == part.title
        assert rec["mode"] == "smoke" and rec["device"] == "cpu"
        assert isinstance(rec["device_name"], str) and rec["device_name"]
        assert rec["torch"] and "cuda" in rec and rec["python"] and rec["mixprec"]
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", rec["git_commit"])
        assert rec["command"] == " ".join(rec["command"].split())  # one shell-quoted line
        started, ended = (datetime.fromisoformat(rec[k]) for k in ("started", "ended"))
        assert started <= ended and rec["duration_s"] >= 0
        assert rec["returncode"] in part.ok_returncodes, (name, rec["returncode"])
        assert isinstance(rec["figures"], dict) and rec["figures"], name
        for key, value in rec["figures"].items():
            assert value is not None or rec["unmeasured"][key], (name, key)
        assert [g["figure"] for g in rec["goals"]] == [g.figure for g in part.goals]
        for g in rec["goals"]:
            assert g["verdict"] in VERDICTS and g["verdict"] != "MISSED", (name, g)
            assert g["figure"] in rec["figures"], (name, g["figure"])
        assert rec["raw"] is not None or name in ("a-cuda-tests", "b-autocast-lists")


@pytest.mark.slow
def test_output_fits_what_the_device_returns(smoke):
    out = smoke["out"]
    entries = sorted(os.listdir(out))
    assert entries == ["bench.png", "logs.tar.gz", "results.json", "summary.md"]
    for name in entries:
        path = out / name
        assert path.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", name)
        assert path.stat().st_size < 16 * 2**20
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    for part in gpu_suite.PARTS:
        assert f"{part.name}/{part.name}.log" in names


@pytest.mark.slow
def test_summary_lists_every_goal_and_part(smoke):
    text = smoke["summary"]
    assert "Smoke run" in text
    for part in gpu_suite.PARTS:
        assert f"| {part.name} | {part.title} | ok |" in text
        for goal in part.goals:
            assert re.search(rf"\| {re.escape(goal.text)} \| {part.name} \| "
                             rf"{re.escape(goal.figure)} \|", text), goal.text  # fmt: skip


@pytest.mark.slow
def test_part_a_selects_every_cuda_test_module(smoke):
    """`pytest -m gpu` must reach every *_cuda.py module (their tests skip without CUDA)."""
    xml = ET.parse(smoke["work"] / "a-cuda-tests" / "a.xml").getroot()
    seen = {case.get("classname") for case in xml.iter("testcase")}
    for path in (ROOT / "tests").glob("*_cuda.py"):
        assert f"tests.{path.stem}" in seen, f"{path.name} has no test marked gpu"


@pytest.mark.slow
def test_ddp_part_trains_both_levels_on_both_ranks_and_passes_its_checks(smoke):
    """benchmarks/ddp_trainstep.py at toy sizes on a CPU (2 gloo ranks, TrainStep with
    ddp=True, O1 and O2), as the smoke's j-ddp part runs it: the step runs eagerly on a CPU
    (nothing is captured) and every check of the script passes."""
    work = smoke["work"] / "j-ddp"
    records = json.loads((work / "j-ddp.json").read_text())
    assert sorted((r["level"], r["rank"]) for r in records) == [
        ("O1", 0), ("O1", 1), ("O2", 0), ("O2", 1),
    ]  # fmt: skip
    assert all(r["failed"] == [] and r["first_captured_call"] is None for r in records)
    assert "checks: all passed" in (work / "j-ddp.log").read_text()


def test_part_a_collects_the_whole_suite_on_a_gpu(tmp_path):
    """On the GPU part a selects from every test module; the smoke run (above) only from those
    that use the gpu mark, which are the same tests without importing the whole suite."""
    part = next(p for p in gpu_suite.PARTS if p.name == "a-cuda-tests")
    assert part.command(_cuda_ctx(tmp_path))[-1] == "tests"
    from suite.parts import GPU_MARK

    smoke = part.command(core.Context(True, "cpu", str(tmp_path), str(ROOT)))
    files = [a for a in smoke if a.startswith("tests/")]
    assert {f"tests/{p.name}" for p in (ROOT / "tests").glob("*_cuda.py")} <= set(files)
    assert "tests/test_autocast_lists.py" in files  # its LSTM/GRU test is marked gpu
    assert all(GPU_MARK.search((ROOT / f).read_text()) for f in files)


def test_summarize_merges_calls_and_keeps_the_ok_record(tmp_path):
    part = gpu_suite.PARTS[0]
    meta = {"mode": "full", "device": "cuda", "device_name": "GPU X", "torch": "2.11",
            "cuda": "13.0", "python": "3.12", "mixprec": "0.6.0",
            "git_commit": "unknown"}  # fmt: skip

    def call_doc(status: str, figure: int | None):
        rec = core.new_record(part, meta, status=status, reason="" if figure == 0 else "boom")
        figures = core.Figures()
        figures.put(part.goals[0].figure, figure, "crashed")
        core.finalize(part, rec, figures, "cuda")
        return {"format": core.FORMAT, "calls": [{**meta, "parts_run": [part.name]}],
                "parts": {part.name: rec}}  # fmt: skip

    dirs = []
    for i, doc in enumerate([call_doc("ok", 0), call_doc("failed", None)]):
        d = tmp_path / f"call{i}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(doc))
        dirs.append(str(d))
    out = tmp_path / "merged"
    assert gpu_suite.main(["--summarize", *dirs, "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())
    assert len(merged["calls"]) == 2 and merged["parts"][part.name]["status"] == "ok"
    text = (out / "summary.md").read_text()
    assert f"| {part.goals[0].text} | {part.name} |" in text and "| MET |" in text
    other = gpu_suite.PARTS[-1]
    assert f"| {other.name} | {other.title} | not run |" in text
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    assert gpu_suite.main(["--summarize", str(tmp_path / "bad.json"), "--out", str(out)]) == 2


def _part(name: str, priority: int, code: str, **kw) -> core.Part:
    """A part running `code` (OUT: where it writes its figure) as a script, like real parts
    (so a `Preloaded` launcher forks it)."""

    def extract(ctx, log):
        with open(ctx.path("value.json")) as fh:
            f = core.Figures()
            f.put("value", json.load(fh))
            return f

    def command(ctx):
        script = Path(ctx.path("part.py"))
        script.write_text(code.replace("OUT", repr(ctx.path("value.json"))))
        return [sys.executable, str(script)]

    kw = {"extract": extract, "estimate_s": 1, "timeout_s": 30, **kw}
    return core.Part(name=name, title=name, priority=priority, command=command,
                     goals=(core.Goal("value", "<=", 1.0, f"{name} value <= 1"),),
                     **kw)  # fmt: skip


@pytest.fixture(scope="module")
def preloaded():
    """A forking launcher as the suite makes one (preloading json only: the smoke run above
    covers torch's preload)."""
    from suite.launch import Preloaded

    launcher = Preloaded(env.part_env(str(ROOT), [], smoke=True), preload=("json",))
    yield launcher
    launcher.close()  # this worker's later forkserver users start their own


@pytest.fixture(params=["fresh", "forked"])
def launcher(request):
    return None if request.param == "fresh" else request.getfixturevalue("preloaded")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper that does not reap counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _process_facts(pid: int) -> str:
    """What /proc says of `pid`: its state, parent, group and signal masks, and its command (a
    fresh-clone CI run once found the hanging part's child alive after the group kill; these
    say whether it ignored or blocked SIGTERM, or was started after the kill)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            keep = ("State", "PPid", "SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")
            lines = [ln.strip() for ln in fh if ln.split(":")[0] in keep]
        with open(f"/proc/{pid}/stat") as fh:
            lines.append("pgrp " + fh.read().rsplit(")", 1)[1].split()[2])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            lines.append("cmdline " + fh.read().replace(b"\0", b" ").decode(errors="replace"))
    except OSError as err:
        lines = [f"/proc/{pid}: {err}"]
    return "\n".join(lines)


def test_failures_are_recorded_and_the_next_part_still_runs(tmp_path, launcher):
    pidfile = tmp_path / "grandchild.pid"
    hang = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "print('hanging', flush=True); time.sleep(120)")  # fmt: skip
    write = "import json; json.dump(0.5, open(OUT, 'w'))"
    parts = [
        _part("x-crash", 1, "import sys; print('boom before the crash'); sys.exit(3)"),
        # Short timeouts (the parts start in well under a second: no torch import), which
        # these tests spend waiting, idle, twice each.
        _part("x-hang", 2, hang, timeout_s=2),
        _part("x-partial", 2, write + "; import time; time.sleep(120)", timeout_s=1),
        _part("x-unreadable", 3, "print('no output file')"),
        _part("x-missing", 4, write, requires=("mixprec_no_such_module",)),
        _part("x-ok", 5, write),
        _part("x-budget", 6, write, estimate_s=10_000),
    ]
    part_env = env.part_env(str(ROOT), [], smoke=True)
    modules = env.probe(part_env, ["mixprec_no_such_module", "json"], str(ROOT))["modules"]
    assert modules["json"] == {"ok": True}
    seen = []
    records = core.run_parts(
        parts, make_ctx=lambda p: core.Context(False, "cpu", str(tmp_path / p.name), str(ROOT)),
        env=part_env, budget_s=120, started=time.monotonic(), meta={"device": "cpu"},
        modules=modules, on_record=seen.append, launcher=launcher)  # fmt: skip
    assert seen == records and [r["part"] for r in records] == [p.name for p in parts]
    by = {r["part"]: r for r in records}
    assert by["x-crash"]["status"] == "failed" and by["x-crash"]["reason"] == "exit status 3"
    assert "boom before the crash" in by["x-crash"]["error_tail"]
    assert by["x-hang"]["status"] == "timeout" and "timeout of 2 s" in by["x-hang"]["reason"]
    assert "hanging" in by["x-hang"]["error_tail"] and by["x-hang"]["figures"] == {}
    partial = by["x-partial"]  # killed too, but it had written its figures: they are kept
    assert partial["status"] == "timeout" and partial["figures"] == {"value": 0.5}
    assert "figures are from the output it wrote before" in partial["reason"]
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), ("the hanging part's child outlived its timeout:\n"
                                    + _process_facts(grandchild))  # fmt: skip
    assert by["x-unreadable"]["status"] == "failed"
    assert "could not be read: FileNotFoundError" in by["x-unreadable"]["reason"]
    missing = by["x-missing"]
    assert missing["status"] == "skipped" and missing["command"] is None
    assert "'mixprec_no_such_module'" in missing["reason"] and "pip download" in missing[
        "reason"] and missing["figures"]["missing_module"] == "mixprec_no_such_module"  # fmt: skip
    ok = by["x-ok"]
    assert ok["status"] == "ok" and ok["figures"] == {"value": 0.5}
    assert ok["goals"][0]["verdict"] == "NOT JUDGED"  # a CPU run
    assert by["x-budget"]["status"] == "skipped" and "--only x-budget" in by["x-budget"]["reason"]
    for rec in records:  # goals of parts that did not produce figures say why
        if rec["status"] != "ok" and rec["part"] != "x-partial":
            assert rec["goals"][0]["verdict"] == "NOT MEASURED" and rec["goals"][0]["detail"]


def test_forked_parts_run_as_fresh_interpreters_would(preloaded, tmp_path):
    script = tmp_path / "part.py"
    script.write_text("import os, sys\n"
                      "print('main' if __name__ == '__main__' else __name__, sys.argv[1:],\n"
                      "      os.getpgid(0) == os.getpid(), os.environ['MPLBACKEND'])\n"
                      "raise ValueError('a part that crashes')\n")  # fmt: skip
    log = tmp_path / "part.log"
    rc, timed_out, out = core.run_command([sys.executable, str(script), "--x", "1"],
                                          cwd=str(ROOT), env=preloaded.env, log_path=str(log),
                                          timeout=60, launcher=preloaded)  # fmt: skip
    assert (rc, timed_out) == (1, False)
    assert "main ['--x', '1'] True Agg" in out  # __main__, argv, its own group, the parts' env
    assert "ValueError: a part that crashes" in out  # the traceback, in the part's log
    data = tmp_path / "data.json"
    data.write_text('{"b": 1}')
    rc, _, out = core.run_command([sys.executable, "-m", "json.tool", str(data)], cwd=str(ROOT),
                                  env=preloaded.env, log_path=str(log), timeout=60,
                                  launcher=preloaded)  # fmt: skip
    assert rc == 0 and '"b": 1' in out
    assert not preloaded.handles(["/bin/sh", "-c", "echo hi"])  # another program: fresh
    assert not preloaded.handles([sys.executable, "-c", "print(1)"])


def test_the_suite_forks_parts_only_after_a_canary_used_the_device(preloaded, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    from suite import launch

    assert preloaded.works(str(tmp_path / "ok")) is None  # a tensor op in a forked child
    monkeypatch.setattr(launch, "_CANARY", "raise SystemExit('CUDA initialization error')")
    broken = preloaded.works(str(tmp_path / "broken"))
    assert broken == "a forked canary failed (exit status 1): CUDA initialization error"


def test_sigterm_stops_the_part_and_keeps_its_record(tmp_path, launcher):
    part = _part("x-slow", 1, "import time; print('started', flush=True); time.sleep(60)")
    seen = []
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    core.install_signal_handlers()
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(core.Stopped):
            core.run_parts([part], make_ctx=lambda p: core.Context(
                False, "cpu", str(tmp_path / p.name), str(ROOT)),
                env=env.part_env(str(ROOT), [], smoke=True), budget_s=120,
                started=t0, meta={}, modules={}, on_record=seen.append,
                launcher=launcher)  # fmt: skip
        assert time.monotonic() - t0 < 30
    finally:
        timer.cancel()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    (rec,) = seen
    assert rec["status"] == "timeout" and "SIGTERM" in rec["reason"]
    assert "started" in rec["error_tail"]


@pytest.mark.parametrize(
    "op,target,value,verdict",
    [("<=", 1.0, 1.0, "MET"), ("<=", 1.0, 1.01, "MISSED"), ("<", 1.0, 1.0, "MISSED"),
     (">=", 1.3, 1.31, "MET"), (">=", 1.3, 1.2, "MISSED"), ("==", 0, 0, "MET"),
     ("==", 0, 2, "MISSED")],
)  # fmt: skip
def test_goal_verdicts(op, target, value, verdict):
    goal = core.Goal("x", op, target, "x")
    figures = core.Figures()
    figures.put("x", value)
    assert goal.judge(figures, "cuda")["verdict"] == verdict
    assert goal.judge(figures, "cpu")["verdict"] == "NOT JUDGED"
    assert core.Goal("x", op, target, "x", cuda_only=False).judge(figures, "cpu")["verdict"] \
        == verdict  # fmt: skip
    absent = core.Figures()
    absent.put("x", None, "manual fp16 failed")
    judged = goal.judge(absent, "cuda")
    assert judged["verdict"] == "NOT MEASURED" and judged["detail"] == "manual fp16 failed"


def test_only_selects_by_name_or_letter_and_rejects_unknown_names():
    names = [p.name for p in gpu_suite.select(gpu_suite.PARTS, "h,d,a-cuda-tests")]
    assert names == ["a-cuda-tests", "d-mlp", "d-resnet50", "d-gpt2", "h-bench"]
    with pytest.raises(SystemExit, match="names no part. Valid: a-cuda-tests"):
        gpu_suite.select(gpu_suite.PARTS, "z")


def test_help_explains_options_parts_and_device_limits(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--out", "--budget-min", "--only", "--smoke", "--summarize", "--wheels",
                 "--commit", "--workdir", "--dry-run"):  # fmt: skip
        assert flag in text
    positions = [text.index(f" {p.name} ") for p in gpu_suite.PARTS]
    assert positions == sorted(positions)  # listed in the order they run
    assert "10 minutes" in text and "8 files" in text and "PYTHONPATH=src" in text


def test_git_commit_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no enclosing repo
    assert env.git_commit(str(tmp_path)) == "unknown"
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs\n" + "a" * 40 + " refs/heads/main\n")
    assert env.git_commit(str(tmp_path)) == "a" * 40  # read by hand (not a repository to git)
    (git / "refs" / "heads" / "main").write_text("b" * 40 + "\n")
    assert env.git_commit(str(tmp_path)) == "b" * 40
    assert env.git_commit(str(tmp_path), "c0ffee") == "c0ffee"


def test_parts_get_the_source_tree_on_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    penv = env.part_env("/repo", ["/wheels/site"], smoke=True)
    assert penv["OMP_NUM_THREADS"] == "1"
    assert penv["PYTHONPATH"].split(os.pathsep) == ["/repo/src", "/wheels/site", "/repo",
                                                    "/elsewhere"]  # fmt: skip
    assert penv["CUDA_VISIBLE_DEVICES"] == "" and penv["PYTHONUNBUFFERED"] == "1"
    full = env.part_env("/repo", [], smoke=False)  # a full run sees the GPU as the caller does
    assert full.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def _cuda_ctx(tmp_path) -> core.Context:
    return core.Context(False, "cuda", str(tmp_path), str(ROOT))


def _judge(part_name: str, figures: core.Figures) -> dict[str, str]:
    part = next(p for p in gpu_suite.PARTS if p.name == part_name)
    return {g.figure: g.judge(figures, "cuda")["verdict"] for g in part.goals}


def test_graph_step_figures_from_a_gpu_shaped_table(tmp_path):
    """What d-* reads from a CUDA run of graph_step (numbers made up, shape as written)."""
    from suite import extract

    ms = {"fp32": 28.0, "torch.amp fp16": 25.0, "torch.amp bf16": 25.0,
          "torch.amp+compile bf16": 18.0, "manual fp16": 5.0, "manual bf16": 7.0,
          "O1 eager fp16": 26.0, "O1 eager bf16": 26.0, "TrainStep O1 fp16": 5.5,
          "TrainStep O1 bf16": 6.3, "TrainStep O2 fp16": 4.5, "TrainStep O1 fp16 any-opt": 6.0,
          "TrainStep O1 bf16+compile": 17.0}  # fmt: skip
    peak = {v: 500.0 for v in ms} | {"TrainStep O2 fp16": 560.0}
    rows = [
        {
            "workload": "resnet50",
            "variant": v,
            "status": "ok",
            "reason": "replaying",
            "ms_per_step": t,
            "peak_MiB": peak[v],
            "captured": True if v.startswith("TrainStep") else None,
        }
        for v, t in ms.items()
    ]
    rows[-2].update(captured=False, reason="running eagerly: a watch is active")
    (tmp_path / "d-resnet50.json").write_text(json.dumps(rows))
    f = extract.extract_graph_step(_cuda_ctx(tmp_path), "", "d-resnet50")
    assert f.values["TrainStep O1 fp16 / manual fp16"] == pytest.approx(1.1)
    assert f.values["TrainStep O1 bf16 / manual bf16"] == pytest.approx(0.9)
    assert f.values["TrainStep O1 fp16 / fp32 eager"] == pytest.approx(5.5 / 28)
    assert f.values["max peak / torch.amp peak"] == pytest.approx(1.12)
    assert f.values["worst peak row"] == "TrainStep O2 fp16 vs torch.amp fp16"
    assert f.values["TrainStep rows not captured"] == {
        "TrainStep O1 fp16 any-opt": "running eagerly: a watch is active"
    }
    assert not f.problems
    assert _judge("d-resnet50", f) == {
        "TrainStep O1 fp16 / manual fp16": "MISSED",
        "TrainStep O1 bf16 / manual bf16": "MET",
        "TrainStep O1 fp16 / fp32 eager": "MET",
        "max peak / torch.amp peak": "MISSED",
    }
    rows[4].update(status="failed", reason="RuntimeError: capture failed")
    (tmp_path / "d-resnet50.json").write_text(json.dumps(rows))
    f = extract.extract_graph_step(_cuda_ctx(tmp_path), "", "d-resnet50")
    assert f.problems == ["manual fp16 failed: RuntimeError: capture failed"]
    assert f.values["TrainStep O1 fp16 / manual fp16"] is None
    assert "capture failed" in f.unmeasured["TrainStep O1 fp16 / manual fp16"]


def test_autocast_list_figures_from_a_gpu_shaped_junit_file(tmp_path):
    from suite import extract

    cases = {"fp16-torch_fp16:conv1d": "", "bf16-torch_fp16:conv1d": "",
             "fp16-torch_fp16:cudnn_convolution": "", "bf16-torch_fp16:gru_cell":
             '<failure message="gru_cell (bf16): mixprec float32 vs torch bfloat16"/>',
             "fp16-torch_expect_builtin_promote:equal": ""}  # fmt: skip
    body = "".join(f'<testcase classname="tests.test_autocast_lists" '
                   f'name="test_cuda_lists_on_gpu[{k}]">{v}</testcase>'
                   for k, v in cases.items())  # fmt: skip
    (tmp_path / "b.xml").write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    f = extract.extract_autocast_lists(_cuda_ctx(tmp_path), "")
    assert (f.values["fp16 entries passed"], f.values["fp16 entries failing"]) == (3, 0)
    assert (f.values["bf16 entries passed"], f.values["bf16 entries failing"]) == (1, 1)
    assert f.values["entries a CPU build cannot run, on this device"] == {
        "fp16-torch_fp16:cudnn_convolution": "passed",
        "bf16-torch_fp16:gru_cell": "failed",
        "fp16-torch_expect_builtin_promote:equal": "passed",
    }
    assert f.problems == ["1 list entries failed: test_cuda_lists_on_gpu[bf16-torch_fp16:gru_cell]"]
    assert f.table[0]["message"] == "gru_cell (bf16): mixprec float32 vs torch bfloat16"
    assert _judge("b-autocast-lists", f) == {"fp16 entries failing": "MET",
                                             "bf16 entries failing": "MISSED"}  # fmt: skip


def test_no_sync_figures_judge_only_the_sync_free_configurations(tmp_path):
    from suite import extract

    rows = [{"kind": "sgd-momentum", "status": "ok", "syncs_per_step": 0.0,
             "expected_syncs_per_step": 0, "skipped_updates": 1, "error_mode": "no sync"},
            {"kind": "adam-foreach", "status": "ok", "syncs_per_step": 1.0,
             "expected_syncs_per_step": 1, "skipped_updates": 1, "error_mode": "raised at x"},
            {"kind": "trainstep-O1-adam", "status": "ok", "syncs_per_step": 0.5,
             "expected_syncs_per_step": 0, "skipped_updates": 1, "error_mode": "raised at y",
             "captured": True}]  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    f = extract.extract_no_sync(_cuda_ctx(tmp_path), "")
    assert f.values["max syncs/step (sync-free configurations)"] == 0.5
    assert f.values["adam-foreach syncs/step"] == 1.0
    assert _judge("c-no-sync", f) == {"max syncs/step (sync-free configurations)": "MISSED"}
    assert f.values["error mode raised in"] == ["adam-foreach", "trainstep-O1-adam"]
    assert not f.problems
    rows[2].update(syncs_per_step=0.0, error_mode="no sync")
    (tmp_path / "c.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    f = extract.extract_no_sync(_cuda_ctx(tmp_path), "")
    assert _judge("c-no-sync", f) == {"max syncs/step (sync-free configurations)": "MET"}
    rows[0]["error_mode"] = "raised at scaler.py:400 step"  # the counts missed a sync
    (tmp_path / "c.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    assert "the count is wrong" in extract.extract_no_sync(_cuda_ctx(tmp_path), "").problems[0]


def test_ddp_failed_checks_count_each_check_once(tmp_path):
    from suite import extract

    # ddp_trainstep.py repeats the run's whole list of failed checks in every record
    failed = ["O1: never captured (capture needs CUDA)"]
    rows = [{"level": level, "dtype": "bf16", "rank": 0, "world_size": 1, "eager_ms": 2.0,
             "captured_ms": 1.0, "speedup": 2.0, "first_captured_call": 12,
             "agrees_with_eager": True, "failed": failed} for level in ("O1", "O2")]  # fmt: skip
    (tmp_path / "j-ddp.json").write_text(json.dumps(rows))
    f = extract.extract_ddp(_cuda_ctx(tmp_path), "")
    assert f.values["failed checks"] == 1
    assert f.values["O1 bf16 captured / eager"] == 0.5
    for r in rows:
        r["failed"] = []
    (tmp_path / "j-ddp.json").write_text(json.dumps(rows))
    assert extract.extract_ddp(_cuda_ctx(tmp_path), "").values["failed checks"] == 0


def test_manual_capture_optimizer_keeps_only_what_the_constructor_takes():
    import graph_step  # benchmarks/, on sys.path once the suite is loaded
    from mixprec.bench.workloads import WORKLOADS

    class Recording(torch.optim.SGD):
        """Records a default its constructor does not take (torch 2.11's AdamW does that)."""

        def __init__(self, params, lr=0.1, momentum=0.0, fused=None):
            super().__init__(params, lr=lr, momentum=momentum, fused=fused)
            self.defaults["decoupled"] = True
            for group in self.param_groups:
                group["decoupled"] = True

    workload = SimpleNamespace(optimizer=lambda m, dev: Recording(m.parameters(), 0.5, 0.9))
    opt = graph_step._fused_optimizer(workload, torch.nn.Linear(4, 4))
    assert type(opt) is Recording
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["fused"]) == (0.5, 0.9, True)
    for name, w in WORKLOADS.items():
        opt = graph_step._fused_optimizer(w, torch.nn.Linear(4, 4))
        assert opt.defaults["fused"] is True, name


def test_graph_step_moves_the_rest_to_a_fresh_process_after_a_cuda_error(tmp_path, monkeypatch):
    """After an illegal memory access every later CUDA call fails (the first H100 run lost all
    TrainStep rows to the manual capture's): the variants left are measured in a new process."""
    import graph_step

    real_build = graph_step.build

    def build(name, *args, **kwargs):
        if name == "torch.amp bf16":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_build(name, *args, **kwargs)

    monkeypatch.setattr(graph_step, "build", build)  # this process only: the child is clean
    out = tmp_path / "rows.json"
    graph_step.main(["--workloads", "mlp", "--variants", "fp32,torch.amp bf16,O1 eager bf16",
                     "--device", "cpu", "--batch", "4", "--steps", "1", "--rounds", "1",
                     "--warmup", "1", "--json", str(out)])  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert rows["fp32"]["status"] == "ok" and "process" not in rows["fp32"]
    assert rows["torch.amp bf16"]["status"] == "failed"
    assert "illegal memory access" in rows["torch.amp bf16"]["reason"]
    fresh = rows["O1 eager bf16"]
    assert fresh["status"] == "ok" and fresh["ms_per_step"] > 0
    assert fresh["process"] == "fresh (after a CUDA error in the parent)"
    assert fresh["x_fp32"] == rows["fp32"]["ms_per_step"] / fresh["ms_per_step"]
    with pytest.raises(SystemExit):
        graph_step.main(["--isolate", "manual fp8", "--device", "cpu"])


def test_graph_step_reports_a_fresh_process_that_crashed(monkeypatch):
    """A segfault (GPT-2's manual capture on the first H100 run) costs only the isolated rows,
    each saying how its process ended."""
    import graph_step

    monkeypatch.setattr(graph_step.subprocess, "run",
                        lambda cmd, check: SimpleNamespace(returncode=-11))  # fmt: skip
    args = graph_step.argparse.Namespace(warmup=1, rounds=1, compile_backend="eager", full=False,
                                         steps=None, batch=None)  # fmt: skip
    rows = graph_step._in_fresh_process(args, "cuda", "gpt2", ["manual fp16", "manual bf16"],
                                        "--isolate")  # fmt: skip
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert "killed by signal 11" in rows[0]["reason"] and rows[1]["variant"] == "manual bf16"


def test_no_sync_counts_syncs_not_the_debug_modes_own_notice(monkeypatch):
    """set_sync_debug_mode warns once that it is a prototype ("...all synchronizing
    operations"); the first H100 run counted that as a sync of the first configuration."""
    import warnings

    import no_sync

    def set_mode(mode):
        if mode == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                          "detect all synchronizing operations", stacklevel=1)  # fmt: skip

    def step(x, y):
        if x:
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    syncs, places = no_sync._count_syncs(step, [(1, 0), (0, 0), (1, 0)])
    assert syncs == 2 and len(places) == 1
