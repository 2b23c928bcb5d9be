"""``mixprec train/bench --nproc-per-node N``: torchrun underneath, run as a user runs it.

The data-parallel runs are real (2 CPU processes over gloo, started by torch.distributed.run);
the argument errors are checked in-process, before anything is launched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from mixprec.cli import main
from mixprec.distributed.launch import torchrun_command

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
]

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mixprec", *args], capture_output=True,
                          text=True, timeout=600, env=ENV)  # fmt: skip


def test_train_runs_data_parallel_with_one_flag(tmp_path):
    # digits (8x8 images): synthetic 32x32 images made this the slowest test (138 s on 2 cores)
    out = _run("train", "--nproc-per-node", "2", "--data", "digits", "--epochs", "1",
               "--modes", "O2", "--batch-size", "128", "--no-progress",
               "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # Rank 0 reports; the other rank trains silently.
    assert out.stdout.count("wrote ") == 1
    assert "2 ranks (gloo)" in out.stdout
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["meta"]["world_size"] == 2
    assert [r["world_size"] for r in result["records"]] == [2]
    assert result["records"][0]["step"] == 1437 // 128  # steps of the global batch
    assert (tmp_path / "train.png").stat().st_size > 0


def test_bench_runs_data_parallel_with_one_flag(tmp_path):
    js = tmp_path / "bench.json"
    out = _run("bench", "mlp", "--nproc-per-node", "2", "--variants", "fp32,O2,trainstep",
               "--steps", "2", "--warmup", "1", "--no-progress", "--json", str(js))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("| 2 ranks under DDP (this rank's timings)") == 1  # rank 0 only
    # The CPU's default budget cannot fit one size for every rank: dropped, and said why.
    said = out.stdout.replace("\n  ", " ")
    assert ("the step counts asked for (no time budget: data-parallel ranks run the same sizes "
            "and steps)") in said and "shrank" not in said  # fmt: skip
    rows = json.loads(js.read_text())
    # TrainStep runs under DDP too: eagerly, since its compiled step places no collectives yet
    assert [(r["variant"], r["status"], r["world_size"]) for r in rows] == [
        ("fp32", "ok", 2), ("O2", "ok", 2), ("trainstep", "ok", 2),
    ]  # fmt: skip
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_the_worker_command_is_torchruns():
    assert torchrun_command(4, ["train", "--epochs", "3"]) == [
        "--standalone", "--nproc-per-node=4", "-m", "mixprec", "train", "--epochs", "3",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["train", "--nproc-per-node", "0"], {}, "--nproc-per-node must be >= 1, got 0."),
        (["bench", "mlp", "--nproc-per-node", "-2"], {}, "--nproc-per-node must be >= 1, got -2."),
        (
            ["train", "--nproc-per-node", "2"],
            {"LOCAL_RANK": "0", "WORLD_SIZE": "2"},
            "--nproc-per-node was given to a process torchrun started (WORLD_SIZE=2): the command "
            "already runs data-parallel. Drop --nproc-per-node, or run mixprec without torchrun.",
        ),
        (
            ["train", "--nproc-per-node", "2", "--batch-size", "63"],
            {},
            "--batch-size 63 cannot be split evenly across 2 ranks: it is the global batch. Use a "
            "multiple of 2, e.g. --batch-size 64.",
        ),
        (
            ["train", "--batch-size", "64"],
            {"LOCAL_RANK": "0", "WORLD_SIZE": "3"},
            "--batch-size 64 cannot be split evenly across 3 ranks: it is the global batch. Use a "
            "multiple of 3, e.g. --batch-size 63.",
        ),
    ],
    ids=["zero", "negative", "inside-torchrun", "uneven-batch", "uneven-under-torchrun"],
)
def test_launch_errors_name_the_fix(argv, env, message, monkeypatch, capsys, tmp_path):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert (
        main([*argv, "--no-progress"] + (["--out", str(tmp_path)] if "train" in argv else [])) == 2
    )
    command = argv[0]
    assert capsys.readouterr().err.strip() == f"mixprec {command}: error: {message}"
    assert not list(tmp_path.iterdir())  # refused before any output was created
