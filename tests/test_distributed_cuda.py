"""The GPU parts of mixprec at scale, run as the GPU suite runs them: DDP captured by TrainStep
over NCCL (a world of one GPU is enough) and FSDP2 memory per rank. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}


def _script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args],
                          capture_output=True, text=True, timeout=900, env=ENV)  # fmt: skip


def test_trainstep_captures_ddp_over_nccl(tmp_path):
    out = _script("ddp_trainstep.py", "--nproc", "1", "--steps", "24", "--width", "256",
                  "--json", str(tmp_path / "ddp.json"))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    records = json.loads((tmp_path / "ddp.json").read_text())
    assert {r["level"] for r in records} == {"O1", "O2"}
    for r in records:
        assert r["failed"] == [] and r["agrees_with_eager"]
        assert r["first_captured_call"] == 12  # 11 eager DDP iterations first (PyTorch's rule)
        assert "replaying the CUDA graph" in r["reason"]


def test_o2_on_fsdp2_adds_no_fp32_copy_on_a_gpu(tmp_path):
    out = _script("fsdp_memory.py", "--device", "cuda", "--nproc", "1", "--width", "512",
                  "--json", str(tmp_path / "mem.json"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads((tmp_path / "mem.json").read_text())}
    assert rows["mixprec O2"]["total"] == rows["fsdp2 mp"]["total"]
    assert rows["mixprec O2"]["masters"] == 0 and rows["unsharded O2"]["masters"] > 0
    assert rows["mixprec O2"]["peak_MiB"] is not None
