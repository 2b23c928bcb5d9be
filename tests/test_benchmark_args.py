"""The benchmark scripts' comma-separated list options, as a user mistypes them.

An empty item (``O1,,O2``, a trailing comma) was dropped, so the run measured fewer rows than
were asked for; an unknown name ended in a KeyError's traceback (or was skipped). Each is now a
usage error (exit status 2, no traceback) that says what was wrong and lists the valid names,
as `mixprec bench --variants` does. Each script's ``main`` runs in this process (a subprocess
would pay a torch import per script); a valid list runs until the first piece of work, which
is replaced by a stop that records its arguments.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_LOADED: dict[str, ModuleType] = {}


def _load(script: str) -> ModuleType:
    """benchmarks/`script`, imported once (registered first: fp16_zoo's dataclasses need it)."""
    if script not in _LOADED:
        name = f"bench_args_{Path(script).stem}"
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _LOADED[script] = module
    return _LOADED[script]


# Every list option: (script, option, two valid names, the start of the valid ones' list).
OPTIONS = [
    ("autocast_overhead.py", "--workloads", "dispatch-bound,gpu-bound", "dispatch-bound, gpu"),
    ("cpu_step.py", "--workloads", "mlp,gpt2", "mlp, resnet50, gpt2"),
    ("cpu_step.py", "--variants", "fp32,O1", "fp32, torch.amp, torch.amp+compile"),
    ("cpu_malloc.py", "--workloads", "mlp,gpt2", "mlp, resnet50, gpt2"),
    ("cpu_malloc.py", "--variants", "fp32,O1", "fp32, torch.amp, torch.amp+compile"),
    ("fp16_zoo.py", "--models", "t5,primer", "t5, gpt_long, deep_prenorm, primer"),
    ("fp8_gpu.py", "--parts", "gemm,loss", "gemm, step, loss"),
    ("fp8_gpu.py", "--recipes", "tensorwise,rowwise", "tensorwise, delayed, rowwise"),
    ("fp8_training.py", "--tasks", "mlp,gpt", "mlp, gpt"),
    ("fp8_training.py", "--recipes", "delayed,true-delayed", "tensorwise, delayed, rowwise, tr"),
    ("graph_amp.py", "--workloads", "gpt2,llama", "gpt2, pingpong, llama"),
    ("graph_step.py", "--workloads", "mlp,gpt2", "mlp, resnet50, gpt2"),
    ("graph_step.py", "--variants", "fp32,torch.amp fp16", "fp32, torch.amp fp16, torch.amp bf16"),
    ("graph_step.py", "--isolate", "fp32,torch.amp fp16", "fp32, torch.amp fp16, torch.amp bf16"),
    ("low_memory.py", "--tasks", "digits,chargpt", "digits, chargpt"),
    ("low_memory.py", "--variants", "fp32,O2", "fp32, O2, O3, O4,"),
    ("no_sync.py", "--kinds", "sgd-momentum,adamw-fused", "sgd-momentum, adam-foreach, "),
    ("watch_overhead.py", "--workloads", "mlp,gpt2", "mlp, resnet50, gpt2"),
    ("cpu_goals.py", "--only", "step,o4", "step, bench, o4, tests"),
    ("gpu_suite.py", "--only", "h,d-mlp", "a-cuda-tests, b-autocast-lists"),
]  # fmt: skip
_IDS = [f"{script[:-3]} {flag}" for script, flag, *_ in OPTIONS]


class _Reached(BaseException):  # not caught by the scripts' `except Exception`
    """A script called its first piece of work: its options were accepted."""


# The functions each script's work starts with: replaced by a stop in every test, so that a
# list a script wrongly accepts ends the test at once instead of running the benchmark.
WORK = {
    "autocast_overhead.py": ["_measure"],
    "cpu_step.py": ["measure_peak", "_build"],
    "cpu_malloc.py": ["_in_process", "child"],
    "fp16_zoo.py": ["run"],
    "fp8_gpu.py": ["bench_gemm", "bench_step", "bench_loss"],
    "fp8_training.py": ["run"],
    "fsdp_fp8.py": ["socket"],  # a socket for the ranks' rendezvous, then the ranks
    "graph_amp.py": ["run"],
    "graph_step.py": ["_measure_row", "_in_fresh_process"],
    "low_memory.py": ["_stdlib_text", "run_digits", "run_chargpt", "speed"],
    "no_sync.py": ["check"],
    "watch_overhead.py": ["measure"],
}


def _guarded(script: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = _load(script)
    for name in WORK.get(script, []):

        def stop(*args: Any, _name: str = name, **kwargs: Any) -> None:
            raise _Reached(_name, args, kwargs)

        monkeypatch.setattr(module, name, SimpleNamespace(socket=stop) if name == "socket"
                            else stop)  # fmt: skip
    return module


def _refused(script: str, argv: list[str], capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> str:  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        _guarded(script, monkeypatch).main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Some scripts set torch's thread count before their work: not this process's.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


def _argv(script: str, flag: str, value: str) -> list[str]:
    # The suites ask for --out unless they only print their plan.
    return [*(["--dry-run"] if script in ("cpu_goals.py", "gpu_suite.py") else []), flag, value]


@pytest.mark.parametrize(("script", "flag", "names", "valid"), OPTIONS, ids=_IDS)
def test_an_empty_item_is_refused_with_the_list_without_it(
    script, flag, names, valid, capsys, monkeypatch
):
    first, second = names.split(",")
    err = _refused(script, _argv(script, flag, f"{first},,{second}"), capsys, monkeypatch)
    assert f"{flag} '{first},,{second}' has an empty item" in err
    assert f"Drop the extra comma ({flag} {shlex.quote(names)})" in err and f"Valid: {valid}" in err


@pytest.mark.parametrize(("script", "flag", "names", "valid"), OPTIONS, ids=_IDS)
def test_an_unknown_item_is_refused_with_the_valid_names(
    script, flag, names, valid, capsys, monkeypatch
):
    first = names.split(",")[0]
    err = _refused(script, _argv(script, flag, f"{first},nosuch"), capsys, monkeypatch)
    if flag == "--only":  # the suites' own wording, which their tests hold
        assert f"--only 'nosuch' names no part. Valid: {valid}" in err
    else:
        assert f"{flag} '{first},nosuch': unknown nosuch; valid: {valid}" in err


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [("watch_overhead.py", ["--workloads", "mlp,"], "'mlp,' has an empty item"),
     ("watch_overhead.py", ["--workloads", ""], "--workloads '' names nothing. Name at least one"),
     ("fp16_zoo.py", ["--models", "t5,t5"], "--models 't5,t5' names 't5' more than once"),
     ("graph_step.py", ["--isolate", ","], "or --isolate '' (none)"),
     ("low_memory.py", ["--variants", ""], "--variants '' names nothing"),
     ("low_memory.py", ["--tasks", "digit"], "unknown digit (did you mean digits?); valid: "),
     ("fp8_gpu.py", ["--recipes", "tensorwise,,"], "(--recipes tensorwise)"),
     ("gpu_suite.py", ["--dry-run", "--only", ""], "--only '' names nothing"),
     ("fsdp_fp8.py", ["--recipe", "rowise"], "invalid choice: 'rowise' (choose from 'tensorw")],
)  # fmt: skip
def test_a_trailing_comma_an_empty_list_or_a_repeated_name(
    script, argv, message, capsys, monkeypatch
):
    assert message in _refused(script, argv, capsys, monkeypatch)


# A valid list: (script, argv, the work it reaches first, a check of that call's arguments).
VALID = [
    ("autocast_overhead.py", ["--workloads", "dispatch-bound"], "_measure",
     lambda a: a[0] == "dispatch-bound"),
    ("cpu_step.py", ["--workloads", "mlp", "--variants", "fp32, O1"], "_build",
     lambda a: a[0] == "fp32"),
    ("cpu_malloc.py", ["--workloads", "gpt2", "--variants", "O2"], "_in_process",
     lambda a: a[0][-5:] == ["gpt2", "O2", "system", "--steps", "20"]),
    ("fp16_zoo.py", ["--models", "primer,t5"], "run", lambda a: a[0].name == "primer"),
    ("fp8_gpu.py", ["--parts", "gemm", "--recipes", "rowwise,tensorwise"], "bench_gemm",
     lambda a: a[3] == ["rowwise", "tensorwise"]),
    ("fp8_training.py", ["--tasks", "gpt", "--recipes", "true-delayed"], "run",
     lambda a: a[:2] == ("gpt", "bf16")),
    ("fsdp_fp8.py", ["--recipe", "rowwise"], "socket", lambda a: True),
    ("graph_amp.py", ["--workloads", "pingpong,gpt2"], "run",
     lambda a: a[5] == ["pingpong", "gpt2"]),
    ("graph_step.py", ["--workloads", "mlp", "--variants", "fp32", "--isolate", ""],
     "_measure_row", lambda a: a[:2] == ("fp32", "mlp")),
    ("low_memory.py", ["--tasks", "digits", "--variants", "O2,fp32"], "run_digits",
     lambda a: a[0] == "O2"),
    ("low_memory.py", ["--tasks", "", "--speed"], "speed", lambda a: True),  # speed only
    ("no_sync.py", ["--kinds", "adamw-fused,sgd-momentum"], "check",
     lambda a: a[0] == "adamw-fused"),
    ("watch_overhead.py", ["--workloads", "gpt2,mlp"], "measure", lambda a: a[0] == "gpt2"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "argv", "work", "check"), VALID,
                         ids=[f"{v[0][:-3]} {' '.join(v[1])}" for v in VALID])  # fmt: skip
def test_a_valid_list_runs(script, argv, work, check, monkeypatch):
    module = _guarded(script, monkeypatch)
    if script == "cpu_step.py":  # its matmul rates come first: a second's measurement each
        monkeypatch.setattr(module, "measure_peak", lambda *a: SimpleNamespace(gflops=1.0))
    with pytest.raises(_Reached) as reached:
        module.main(argv)
    name, args, _ = reached.value.args
    assert name == work and check(args), reached.value.args


@pytest.mark.parametrize(("script", "only", "parts"),
                         [("cpu_goals.py", "o4,step", {"step", "o4"}),
                          ("gpu_suite.py", " h , d-mlp", {"d-mlp", "h-bench"})])  # fmt: skip
def test_a_valid_only_list_selects_its_parts(script, only, parts, capsys):
    module = _load(script)
    assert module.main(["--dry-run", "--only", only]) == 0
    assert {p.name for p in module.select(module.PARTS, only)} == parts
    out = capsys.readouterr().out
    assert all(name in out for name in parts)


def test_a_script_run_as_a_command_exits_2_without_a_traceback():
    # The suite's --only is checked outside argparse (by suite.parts.select), and the scripts
    # import the helper from benchmarks/suite: run as a command, as people do.
    argv = [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--dry-run", "--only", "h,,d"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("gpu_suite: error: --only 'h,,d' has an empty item")
    assert "Traceback" not in proc.stderr and not proc.stdout
