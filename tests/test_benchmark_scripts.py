"""The benchmark scripts as a user meets them: every option has a help text (users run
``benchmarks/<script>.py --help`` to learn what an option counts or selects, its unit and its
default, and expect an answer for each one), and their summaries hold for every valid option.

The help check reads the scripts' syntax trees (no import: milliseconds); two scripts also
print their help, in this process (a subprocess would pay a torch import per script).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _add_argument_calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"]  # fmt: skip


def _names(call: ast.Call) -> list[str]:
    return [str(a.value) for a in call.args if isinstance(a, ast.Constant)]


def _has_help(call: ast.Call) -> bool:
    """A ``help=`` that is not an empty (or None) literal: a string, an f-string, a sum of
    strings, or ``argparse.SUPPRESS``."""
    for kw in call.keywords:
        if kw.arg == "help":
            if isinstance(kw.value, ast.Constant):
                return isinstance(kw.value.value, str) and bool(kw.value.value.strip())
            return True
    return False


def test_scripts_have_options():
    assert len(SCRIPTS) > 10
    assert sum(len(_add_argument_calls(p)) for p in SCRIPTS) > 50


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_option_has_help(path: Path):
    missing = ["/".join(_names(c)) or f"line {c.lineno}"
               for c in _add_argument_calls(path) if not _has_help(c)]  # fmt: skip
    assert not missing, f"benchmarks/{path.name}: options without help=: {', '.join(missing)}"


def _load(script: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["low_memory.py", "fp8_training.py"])
def test_help_runs(script: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        _load(script).main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    options = [n for c in _add_argument_calls(BENCHMARKS / script) for n in _names(c)
               if n.startswith("--")]  # fmt: skip
    assert options
    for option in options:
        assert option in out, f"{script} --help does not mention {option}"


def test_fsdp_fp8_summary_of_a_recipe_without_fp8_gathers():
    # rowwise layers are gathered in bf16: every gather has the bf16 size (the summary divided
    # by an empty sum), and a tensorwise run's FP8 blocks are reported as before.
    bench = _load("fsdp_fp8.py")
    args = argparse.Namespace(depth=2, nproc=2)

    def ranks(fp8_gathers: list[int]) -> list[dict]:
        memory = {"total": 100}
        return [{"fp8 gathers": fp8_gathers, "bf16 gathers": [64, 256, 256], "fp8 memory": memory,
                 "bf16 memory": memory, "reference losses": [[1.0, 2.0]],
                 "fp8 losses": [[1.0, 2.5]], "fp8 ms": 3.0, "bf16 ms": 2.0}]  # fmt: skip

    rowwise = bench.summarize(ranks([64, 256, 256]), args)
    assert rowwise["bytes per step, fp8 / bf16 (all units)"] == 1.0
    assert "no FP8 all-gather" in rowwise["bytes per step, fp8 / bf16 (FP8 blocks)"]
    assert rowwise["max |loss - one process| (fp8)"] == 0.5
    tensorwise = bench.summarize(ranks([64, 128, 128]), args)
    assert tensorwise["bytes per step, fp8 / bf16 (FP8 blocks)"] == 0.5
    assert tensorwise["unsharded weights of one block, bytes (fp8, bf16)"] == [256, 512]


@pytest.mark.parametrize(
    ("script", "argv", "valid"),
    [("low_memory.py", ["--tasks", "digit"], "valid: digits, chargpt"),
     ("low_memory.py", ["--variants", "O2,O5"], "valid: fp32, O2, O3, O4,"),
     ("fp8_gpu.py", ["--parts", "gem"], "valid: gemm, step, loss")],
)  # fmt: skip
def test_an_unknown_name_in_a_list_option_is_refused_with_the_valid_ones(
    script: str, argv: list[str], valid: str, capsys: pytest.CaptureFixture[str]
):
    # They were ignored (fp8_gpu's parts) or taken as another task (low_memory's chargpt).
    with pytest.raises(SystemExit) as exit_:
        _load(script).main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown {argv[1].split(',')[-1]}" in err and valid in err
