"""benchmarks/cpu_goals.py: each part's figures read from what its benchmark really wrote (the
committed results of cpu_step.py, mixprec bench and low_memory.py), goals judged only on a CPU
that can settle them, the timing wrapper, the probe's verdict on fast bf16, and the options.

The parts themselves are the benchmarks, run by their own tests; ``--smoke`` runs them all at
toy sizes (2-3 minutes), which is left to the command line rather than the suite."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load():
    spec = importlib.util.spec_from_file_location("cpu_goals", ROOT / "benchmarks" / "cpu_goals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for its `suite` package
    return module


cg = _load()
from suite.core import Context, Goal  # noqa: E402  (benchmarks/suite, importable after the load)

SLOW_BF16 = {cg.FAST: "bf16 at 0.01x fp32's rate"}


def _ctx(tmp_path: Path, **files: Path) -> Context:
    for name, src in files.items():
        shutil.copy(src, tmp_path / name)
    return Context(False, "cpu", str(tmp_path), str(ROOT))


def _part(name: str):
    return next(p for p in cg.PARTS if p.name == name)


def _judged(name: str, figures, lacks=None) -> dict[str, dict]:
    return {g.figure: g.judge(figures, "cpu", "", lacks) for g in _part(name).goals}


def test_step_figures_are_the_ratios_of_cpu_steps_rows(tmp_path):
    figures = cg.extract_step(_ctx(tmp_path, **{"step.json": RESULTS / "cpu_step_cpu.json"}), "")
    rows = {(r["workload"], r["variant"]): r["ms_per_step"]
            for r in json.loads((RESULTS / "cpu_step_cpu.json").read_text())["rows"]}  # fmt: skip
    v = figures.values
    # GPT-2's goals are TrainStep O1's; the MLP and ResNet-50 take the faster TrainStep level.
    assert v["gpt2: TrainStep / torch.amp eager"] == pytest.approx(
        rows[("gpt2", "torch.amp")] / rows[("gpt2", "TrainStep O1")]
    )
    best_mlp = min(rows[("mlp", "TrainStep O1")], rows[("mlp", "TrainStep O2")])
    assert v["mlp: TrainStep / torch.amp+compile"] == pytest.approx(
        rows[("mlp", "torch.amp+compile")] / best_mlp
    )
    assert v["TrainStep recompilations under the LR schedule (most)"] == 0
    assert v["gpt2: TrainStep first compile s"] > 0
    # On the AVX2 CPU that produced these rows the speed-ups are shown, not judged...
    slow = _judged("step", figures, SLOW_BF16)
    assert slow["gpt2: TrainStep / torch.amp eager"]["verdict"] == "NOT JUDGED"
    assert slow["gpt2: TrainStep / torch.amp eager"]["detail"] == SLOW_BF16[cg.FAST]
    assert slow["TrainStep recompilations under the LR schedule (most)"]["verdict"] == "MET"
    # ...and on a CPU with fast bf16 each is judged against its target.
    for figure, g in _judged("step", figures, {}).items():
        assert g["verdict"] == ("MET" if Goal(figure, g["op"], g["target"], "").judge(
            figures, "cuda")["verdict"] == "MET" else "MISSED"), figure  # fmt: skip


def test_a_workload_that_did_not_run_is_not_measured_with_the_reason(tmp_path):
    doc = json.loads((RESULTS / "cpu_step_cpu.json").read_text())
    doc["rows"] = [r for r in doc["rows"] if r["workload"] == "gpt2"]
    (tmp_path / "step.json").write_text(json.dumps(doc))
    figures = cg.extract_step(_ctx(tmp_path), "")
    judged = _judged("step", figures, {})
    assert judged["mlp: TrainStep / torch.amp eager"]["verdict"] == "NOT MEASURED"
    assert "mlp was not run" in judged["mlp: TrainStep / torch.amp eager"]["detail"]
    assert judged["gpt2: TrainStep / torch.amp eager"]["verdict"] in ("MET", "MISSED")


def test_bench_figures_take_the_fastest_mixprec_row_of_the_worst_workload(tmp_path):
    ctx = _ctx(tmp_path, **{"bench.json": RESULTS / "bench_cpu_epyc.json"})
    (tmp_path / "seconds.json").write_text("95.5")
    figures = cg.extract_bench(ctx, "")
    rows = json.loads((RESULTS / "bench_cpu_epyc.json").read_text())
    want = min(
        next(r["ms_per_step"] for r in rows if r["workload"] == w and r["variant"] == "fp32")
        / min(r["ms_per_step"] for r in rows if r["workload"] == w and r["status"] == "ok"
              and r["variant"] in cg.MIXPREC_BENCH_ROWS)
        for w in {r["workload"] for r in rows})  # fmt: skip
    assert figures.values["fastest mixprec row / fp32, worst workload"] == pytest.approx(want)
    assert figures.values["first run s (empty compile cache)"] == 95.5
    assert figures.values["bf16 / fp32 matmul rate"] > 4  # the avx512_bf16 EPYC's 4.4x
    assert {g["verdict"] for g in _judged("bench", figures, {}).values()} == {"MET"}


def test_o4_figure_is_low_memorys_ratio(tmp_path):
    figures = cg.extract_o4(_ctx(tmp_path, **{"o4.json": RESULTS / "low_memory_cpu.json"}), "")
    speed = json.loads((RESULTS / "low_memory_cpu.json").read_text())["speed"]
    assert figures.values["O4 / O2 step time"] == speed["O4_over_O2"]
    # Judged on any CPU: the goal does not need fast bf16.
    (goal,) = _judged("o4", figures, SLOW_BF16).values()
    assert goal["verdict"] == ("MET" if speed["O4_over_O2"] <= 1.15 else "MISSED")
    # The committed run has O4 with exact block maxima too: reported beside the goal's figure.
    assert figures.values["O4 (8bit) / O2 step time"] == speed["O4-exact_over_O2"]
    # Runs before the round-by-round ratios and the bound variant lack those figures.
    old = {k: v for k, v in speed.items() if k in ("O2", "O4", "O4_over_O2")}
    (tmp_path / "o4.json").write_text(json.dumps({"speed": old}))
    figures = cg.extract_o4(_ctx(tmp_path), "")
    assert figures.unmeasured["O4 / O2, round by round: median"] == "no rounds"
    assert figures.unmeasured["O4 (8bit) / O2 step time"] == "O4-exact did not run"
    (tmp_path / "o4.json").write_text(json.dumps({"speed": {**old, "O4_over_O2_rounds": [
        1.31, 1.09, 1.2, 1.12]}}))  # fmt: skip
    figures = cg.extract_o4(_ctx(tmp_path), "")
    assert figures.values["O4 / O2, round by round: median"] == pytest.approx(1.16)
    (goal,) = _judged("o4", figures, SLOW_BF16).values()
    assert goal["value"] == speed["O4_over_O2"]  # the goal stays O4's own


def test_tests_figures_come_from_the_timing_and_pytests_summary(tmp_path):
    (tmp_path / "seconds.json").write_text("519.9")
    ctx = _ctx(tmp_path)
    ok = cg.extract_tests(ctx, "....\n1758 passed, 96 skipped, 74 warnings in 519.88s (0:08:39)\n")
    assert ok.values == {"test suite wall s": 519.9, "tests passed": 1758} and not ok.problems
    (goal,) = _judged("tests", ok, SLOW_BF16).values()
    assert goal["verdict"] == "MISSED" and goal["target"] == 360
    bad = cg.extract_tests(ctx, "2 failed, 1756 passed, 96 skipped in 530.1s\n")
    assert bad.problems == ["tests failed: {'failed': 2, 'passed': 1756, 'skipped': 96}"]


def test_time_to_runs_the_command_with_its_environment_and_writes_seconds(tmp_path):
    out = tmp_path / "seconds.json"
    code = "import os, sys; sys.exit(int(os.environ['MIXPREC_X']))"
    rc = cg.main(["--time-to", str(out), "--set-env", "MIXPREC_X=3", "--",
                  sys.executable, "-c", code])  # fmt: skip
    assert rc == 3 and 0 < json.loads(out.read_text()) < 60
    with pytest.raises(SystemExit, match="--time-to needs FILE, then -- and a command"):
        cg.main(["--time-to", str(out)])


def test_probe_says_why_a_cpu_lacks_fast_bf16(monkeypatch):
    from mixprec.bench import budget

    rates = {"fp32": 140e9, "bf16": 1.7e9}
    monkeypatch.setattr(budget, "measure_peak",
                        lambda device, name: budget.Peak(name, rates[name], 512, 2))  # fmt: skip
    info, lacks = cg.probe()
    assert info["matmul_gflops"] == {"fp32": 140.0, "bf16": 1.7}
    assert "bf16 matmuls run at 0.012x fp32's rate (2 vs 140 GFLOP/s" in lacks[cg.FAST]
    rates["bf16"] = 600e9  # an AMX or avx512_bf16 CPU
    assert cg.probe()[1] == {}


def test_dry_run_and_unknown_parts(capsys):
    assert cg.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for part in ("step", "bench", "o4", "tests"):
        assert f"\n{part}" in "\n" + out
    assert "cpu_step.py" in out and "low_memory.py --tasks '' --speed" in out
    assert "TORCHINDUCTOR_CACHE_DIR=" in out  # the README's first run, with an empty cache
    with pytest.raises(SystemExit, match=r"cpu_goals: error: --only 'x' names no part. Valid: "
                       r"step, bench, o4, tests\.$"):  # fmt: skip
        cg.main(["--dry-run", "--only", "x"])
