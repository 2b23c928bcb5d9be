"""`mixprec.keep_cpu_memory`: freed CPU memory kept for the next step, measured in page faults.

The reference is the kernel's own count of minor page faults (``getrusage``): an 8 MiB tensor
allocated, written and freed in a loop, as a training step's buffers are. Each check runs in its
own process, because the setting is process-wide.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import mixprec

_LOOP = """
import resource, sys, torch, mixprec
print(mixprec.keep_cpu_memory(sys.argv[1] == "keep"), file=sys.stderr)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    torch.empty(2 * 1024 * 1024).fill_(1.0)  # 8 MiB, written, freed
before = faults()
for _ in range(10):
    torch.empty(2 * 1024 * 1024).fill_(1.0)
print((faults() - before) / 10)
"""


def _faults_per_loop(setting: str) -> float:
    done = subprocess.run([sys.executable, "-c", _LOOP, setting], capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_is_reused_without_page_faults():
    kept = _faults_per_loop("keep")
    returned = _faults_per_loop("defaults")  # glibc's fixed 128 KiB threshold: mapped each time
    assert kept < 50, kept
    assert returned > 1000, returned  # 8 MiB of fresh 4 KiB pages: about 2,048 faults


def test_what_it_says_and_what_it_refuses(monkeypatch):
    for bad in ({"mmap_threshold": 64 * 2**20}, {"trim_threshold": -1}, {"top_pad": 1.5},
                {"mmap_threshold": True}):  # fmt: skip
        with pytest.raises(ValueError, match="byte count from 0 to") as err:
            mixprec.keep_cpu_memory(**bad)
        assert "leave it out for the default" in str(err.value)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    other = mixprec.keep_cpu_memory()
    assert not other.kept and other.mmap_threshold is None
    assert "not glibc: nothing changed" in str(other)


def test_the_benchmark_compares_both_settings_in_separate_processes(tmp_path):
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_malloc.py"
    out = tmp_path / "malloc.json"
    subprocess.run([sys.executable, str(script), "--workloads", "mlp", "--variants", "torch.amp",
                    "--rounds", "1", "--steps", "2", "--smoke", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["system_ms"] > 0 and row["keep_ms"] > 0
    assert row["keep_runs"][0]["setting"].startswith("CPU memory: ")
    assert row["system_runs"][0]["setting"] == "system"
