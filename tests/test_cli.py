"""The console script, run as a user runs it (a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import mixprec


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mixprec", *args], capture_output=True, text=True, timeout=120
    )


def test_help_explains():
    out = _run("--help")
    assert out.returncode == 0
    assert "mixed-precision" in out.stdout and "policy" in out.stdout and "examples:" in out.stdout


def test_version():
    out = _run("--version")
    assert out.returncode == 0
    assert f"mixprec {mixprec.__version__}" in out.stdout and "torch" in out.stdout


def test_policy_listing_and_single_ops():
    out = _run("policy", "--device", "cuda")
    assert out.returncode == 0
    assert "lower (" in out.stdout and "mm" in out.stdout and "fp32_output" in out.stdout
    out = _run("policy", "--device", "cpu", "--policy", "fp32=softmax", "--op", "softmax", "mm")
    assert out.returncode == 0
    assert "softmax: fp32 -> float32 (moved to fp32 by Policy.move)" in out.stdout
    assert "mm: lower -> bfloat16" in out.stdout


def test_policy_errors_are_clear():
    out = _run("policy", "--device", "gpu")
    assert out.returncode == 2 and "unknown device type 'gpu'" in out.stderr
    out = _run("policy", "--op", "sofmax")
    assert out.returncode == 2 and "Did you mean" in out.stderr
    assert "Traceback" not in out.stderr
