"""The console script, run as a user runs it (a process of its own): help texts, tiny bench
and train runs that write JSON and PNG files, the CIFAR-10 loader on a file in CIFAR's own
format, and every error path (bad names, CUDA without CUDA, unwritable outputs) failing before
any work.

Each ``python -m mixprec ...`` is forked from one server that imported torch and mixprec once
(the GPU suite's launcher, `benchmarks/suite/launch.py`): its own process, argv, environment,
stdout, stderr and exit status, without 4 s of imports per command. ``--version`` and one bad
name run in a fresh interpreter, so the console entry's own imports stay covered.
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.bench import data as datasets

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
_SERVER: list = []  # the preloaded launcher, started by the first command


def _launcher():
    if not _SERVER:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from suite.launch import Preloaded

        _SERVER.append(Preloaded(ENV, preload=("torch", "torch._dynamo", "mixprec")))
    return _SERVER[0]


def _run(*args: str, timeout: int = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m mixprec *args``: forked from the preloaded server, or a fresh interpreter."""
    argv = [sys.executable, "-m", "mixprec", *args]
    if fresh:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV)
    with tempfile.TemporaryDirectory(prefix="mixprec-cli-") as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        rc, timed_out = _launcher().run(argv, cwd=os.getcwd(), log_path=str(out),
                                        err_path=str(err), timeout=timeout)  # fmt: skip
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())


def test_help_texts():
    out = _run("--help")
    assert out.returncode == 0
    for word in ("bench", "train", "policy", "explain", "examples:", "mixed-precision"):
        assert word in out.stdout
    bench = _run("bench", "--help").stdout
    for word in ("--full", "--variants", "mlp", "resnet50", "gpt2", "torch.amp", "O2",
                 "listed with the reason", "--budget", "reduced",
                 "the first run compiles the TrainStep rows"):  # fmt: skip
        assert word in bench, word
    train = _run("train", "--help").stdout
    assert "scikit-learn" in train and "cifar10:PATH" in train and "--seeds" in train


def test_bench_can_keep_freed_cpu_memory(tmp_path):
    # Forked from the preloaded server: the process-wide setting stays in that child.
    out = _run("bench", "mlp", "--steps", "1", "--warmup", "0", "--budget", "none",
               "--variants", "fp32,O1", "--malloc", "keep")  # fmt: skip
    assert out.returncode == 0, out.stderr
    if platform.libc_ver()[0] == "glibc":
        assert "--malloc keep: CPU memory: kept: glibc" in out.stdout
    bad = _run("bench", "mlp", "--malloc", "jemalloc")
    assert bad.returncode == 2 and "invalid choice: 'jemalloc'" in bad.stderr


def test_version():
    out = _run("--version", fresh=True)
    assert out.returncode == 0 and f"mixprec {mixprec.__version__}" in out.stdout


def test_tiny_bench_writes_json_and_png(tmp_path):
    js, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # --budget none: on a loaded machine the default budget shrank the 16-bit rows and added an
    # fp32 row at their size (a CI run under load failed on it); tests/test_bench.py covers that.
    out = _run("bench", "mlp", "--steps", "1", "--warmup", "0", "--budget", "none",
               "--json", str(js), "--plot", str(png))  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(js.read_text())
    assert [r["variant"] for r in rows] == ["fp32", "tf32", "torch.amp", "O1", "O2", "O3",
                                            "trainstep"]  # fmt: skip
    by = {r["variant"]: r for r in rows}
    assert by["tf32"]["status"] == "skipped" and "TF32" in by["tf32"]["reason"]
    # On a CPU the TrainStep row is the compiled whole step, its compile time on its own.
    assert by["trainstep"]["compile_s"] > 0
    for name in ("fp32", "torch.amp", "O1", "O2", "O3", "trainstep"):
        r = by[name]
        assert r["status"] == "ok" and r["ms_per_step"] > 0 and r["final_loss"] > 0
        assert r["torch"] == torch.__version__ and r["command"].startswith("mixprec bench")
    # Peak memory (torch.profiler's allocation events on a CPU): fp32 weights and gradients
    # (3 x 1024^2 each, SGD keeps no state) in fp32, O1 and the compiled TrainStep, whose
    # kernels read the weights where the profiler records no op; O2/O3 hold less.
    fp32_state = 2 * 3 * 1024**2 * 4 / 2**20
    for name in ("fp32", "torch.amp", "O1", "trainstep"):
        assert by[name]["peak_memory_MiB"] >= fp32_state, by[name]
    assert 0 < by["O3"]["peak_memory_MiB"] < by["fp32"]["peak_memory_MiB"]
    assert by["fp32"]["speedup_vs_fp32"] == 1.0 and by["torch.amp"]["speedup_vs_torch_amp"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped: TF32" in out.stdout and "ms/step" in out.stdout
    # The progress line says what the minutes of a first compile are spent on, and the
    # profiler's own start/stop lines (native writes to stderr) do not break it up.
    assert "compiling trainstep" in out.stderr
    assert "profiler_start" not in out.stderr and "profiler_stop" not in out.stderr


@pytest.fixture(scope="module")
def tiny_train(tmp_path_factory):
    """One tiny `mixprec train` run (progress on), read by the tests of its outputs and of its
    progress lines: the command is the slow part, and both look at the same run."""
    run = tmp_path_factory.mktemp("train") / "run"
    return run, _run("train", "--epochs", "1", "--modes", "fp32,O2", "--out", str(run))


def test_tiny_train_writes_png_and_json(tiny_train):
    run, out = tiny_train
    assert out.returncode == 0, out.stderr
    result = json.loads((run / "train.json").read_text())
    assert {s["mode"] for s in result["summary"]} == {"fp32", "O2"}
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in result["records"])
    assert result["meta"]["data"].startswith("digits: 1437 train / 360 test")
    assert (run / "train.png").read_bytes()[:4] == b"\x89PNG"
    assert "within noise" in out.stdout or "OUTSIDE noise" in out.stdout
    # Training state per parameter, exact from the tensors (mixprec.memory_report): fp32
    # AdamW holds 16 bytes (and a few step counters); O2 holds more (bf16 weights besides the
    # fp32 masters).
    held = {s["mode"]: s["state_bytes_per_param"] for s in result["summary"]}
    assert 16.0 <= held["fp32"] < 16.01 and held["O2"] > held["fp32"]
    assert "B/param" in out.stdout


def test_digits_are_scikit_learns_without_importing_it(monkeypatch):
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    reference = sklearn_datasets.load_digits()
    # Read from the bundled file: load_digits (and the 3 s import behind it) is never called.
    monkeypatch.setattr(sklearn_datasets, "load_digits", lambda *a, **k: pytest.fail("called"))
    pixels, labels = datasets.digits_arrays()
    assert torch.equal(pixels, torch.tensor(reference.data, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(reference.target, dtype=torch.long))
    # Without scikit-learn: the error says what to install, or which data set needs nothing.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(datasets.DataError, match=r"scikit-learn: pip .*--data synthetic"):
        datasets.digits_arrays()


def test_cifar10_loader_reads_the_python_pickle_format(tmp_path):
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 6) for i in range(1, 6)), ("test_batch", 4)]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, n)),
            b"batch_label": name.encode(),
        }
        with open(tmp_path / name, "wb") as fh:
            pickle.dump(batch, fh)
    ds = datasets.load(f"cifar10:{tmp_path}")
    assert ds.train_x.shape == (30, 3, 32, 32) and ds.test_x.shape == (4, 3, 32, 32)
    assert ds.train_y.dtype == torch.long and ds.num_classes == 10
    assert abs(ds.train_x.mean().item()) < 1e-5  # normalized per channel
    out = _run("train", "--data", f"cifar10:{tmp_path}", "--epochs", "1", "--batch-size", "8",
               "--modes", "fp32", "--no-progress", "--out", str(tmp_path / "out"))  # fmt: skip
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["bench", "vgg"], "unknown benchmark 'vgg'. Valid: mlp, resnet50, gpt2 or all."),
        (["bench", "--variants", "fp32,O4"], "unknown --variants 'O4'. Valid: fp32, tf32"),
        (["bench", "--device", "tpu"], "unknown --device 'tpu'. Valid: 'auto', 'cpu' or 'cuda'"),
        (["bench", "--dtype", "fp8"], "unknown --dtype 'fp8'. Valid: 'auto', 'bf16' or 'fp16'"),
        (["bench", "--steps", "0"], "--steps must be >= 1"),
        (["bench", "--budget", "-5"], "--budget '-5' is not a number of seconds > 0"),
        (["bench", "--budget", "soon"], "Valid: a number such as 60, 'auto'"),
        (["train", "--modes", "fp32,O9"], "unknown --modes 'O9'. Valid: fp32, torch.amp"),
        (["train", "--model", "vit"], "unknown --model 'vit'. Valid: cnn, resnet50"),
        (["train", "--data", "mnist"], "unknown data set 'mnist'. Valid: 'digits'"),
        (["train", "--epochs", "0"], "--epochs must be >= 1"),
        (["policy", "--device", "gpu", "--op", "mm"], "unknown device type 'gpu'"),
        (["policy", "--op", "mm", "notanop"], "unknown op name 'notanop'"),
        (["explain", "vgg"], "unknown model 'vgg'. Valid: mlp, resnet50, gpt2"),
        (["explain", "mlp", "--batch", "0"], "--batch must be >= 1"),
        (["explain", "mlp", "--dtype", "fp8"], "unknown --dtype 'fp8'"),
        (["explain", "mlp", "--policy", "fp33=mm"], "fp33"),
    ],
)
def test_bad_names_list_the_valid_ones(args, message, capsys):
    # In this process: each case fails in argument checking, before any work (a subprocess
    # each cost 4 s of imports); the console script's own path is checked just below.
    from mixprec.cli import main

    assert main(args) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    assert "Traceback" not in err
    assert not out  # nothing half-printed before the error (policy's header did)


def test_a_bad_name_from_the_console_script_exits_2_without_a_traceback():
    out = _run("bench", "vgg", fresh=True)
    assert out.returncode == 2, out.stdout
    assert "unknown benchmark 'vgg'. Valid: mlp, resnet50, gpt2 or all." in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("command", ["bench", "train"])
def test_cuda_without_cuda_says_so(command, capsys):
    from mixprec.cli import main

    assert main([command, "--device", "cuda", "--no-progress"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_unwritable_outputs_fail_before_any_work(tmp_path):
    cases = [
        (["bench", "--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
        (["bench", "--plot", str(tmp_path)], "is a directory"),
        (["train", "--out", "/proc/mixprec-cannot-write"], "cannot be created"),
    ]
    for args, message in cases:
        out = _run(*args, "--no-progress", timeout=60)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "ms/step" not in out.stdout  # nothing ran


def test_cifar10_missing_files_are_named(tmp_path):
    out = _run("train", "--data", f"cifar10:{tmp_path}", "--no-progress",
               "--out", str(tmp_path / "o"))  # fmt: skip
    assert out.returncode == 2 and "expected CIFAR-10's python files" in out.stderr


def test_policy_command():
    out = _run("policy", "--device", "cpu", "--policy", "fp32=softmax", "--op", "softmax", "mm")
    assert out.returncode == 0
    assert "softmax: fp32 -> float32 (moved to fp32 by Policy.move)" in out.stdout


def test_explain_command_prints_the_table_and_writes_json(tmp_path):
    path = tmp_path / "explain.json"
    out = _run("explain", "gpt2", "--policy", "fp32=layer_norm", "--backward", "--json", str(path))
    assert out.returncode == 0, out.stderr
    for word in ("layer_norm", "moved to fp32 by Policy.move", "lower", "FLOPs in low precision"):
        assert word in out.stdout, word
    doc = json.loads(path.read_text())
    assert doc["summary"]["dtype"] == "bf16" and doc["rows"]
    assert doc["summary"]["low_precision_flop_share"]["backward"] is not None
    assert "ping-pong" in _run("explain", "--help").stdout
    bad = _run("explain", "mlp", "--json", str(tmp_path / "missing" / "x.json"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_explain_footer_points_cli_users_at_all():
    out = _run("explain", "mlp")
    assert out.returncode == 0, out.stderr
    assert "`mixprec explain mlp --all` lists them" in out.stdout
    assert "report.format" not in out.stdout


def test_train_progress_says_which_mode_runs(tiny_train):
    _, out = tiny_train
    assert out.returncode == 0, out.stderr
    assert "fp32 (fp32), seed 0: epoch 1/1" in out.stderr
    assert "O2 (bf16), seed 0: epoch 1/1" in out.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["bench", "--mode", "O5"], ["--mode is not an option", "'O5' is not a valid variant"]),
        (["bench", "--mode=O2"], ["Use --variants O2."]),
        (["bench", "--opt-level", "O1", "mlp"], ["Use --variants O1."]),
        (["train", "--opt-level", "O1,O9"], ["'O9' is not a valid mode", "--modes"]),
        (["bench", "--jsn", "r.json"], ["unknown option --jsn. Did you mean --json?"]),
        (["bench", "mlp", "gpt2"], ["unexpected argument 'gpt2'"]),
    ],
)
def test_unknown_options_point_to_the_option_meant(args, expected, capsys):
    from mixprec.bench.train import MODES
    from mixprec.bench.variants import VARIANTS
    from mixprec.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mixprec {args[0]}: error: "), err
    assert "usage: mixprec [-h]" not in err  # not argparse's top-level usage
    for text in expected:
        assert text in err, err
    if "not a valid" in err:  # the valid names are the ones the option accepts
        valid, flag = (VARIANTS, "--variants") if args[0] == "bench" else (MODES, "--modes")
        assert f"{flag} (comma-separated)" in err and ", ".join(valid) in err, err


def test_train_names_every_extra_it_needs(tmp_path, monkeypatch, capsys):
    from mixprec.cli import main

    # as if installed without the data and tensorboard extras (matplotlib present)
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    out = tmp_path / "out"
    args = ["train", "--tensorboard", str(tmp_path / "tb"), "--out", str(out), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "mixprec train --tensorboard needs the extras plots, data, tensorboard" in err, err
    assert "not installed: scikit-learn, tensorboard" in err, err
    assert "pip install -e '.[plots,data,tensorboard]' in the mixprec checkout" in err, err
    assert not (out / "train.json").exists()
    # without --tensorboard, on synthetic data, nothing is missing: the check passes
    from mixprec.cli import _parser, _require_train_extras

    _require_train_extras(_parser().parse_args(["train", "--data", "synthetic"]))
