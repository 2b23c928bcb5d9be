"""The public surface: a snapshot of __all__ (any change shows up as a diff), and import cost."""

from __future__ import annotations

import subprocess
import sys

import mixprec

EXPECTED = [
    "AmpBackend", "AmpMetrics", "AmpOptimizer", "AutocastError", "BannedOpError", "CastReport",
    "Decision", "DistributedError", "GradScaler", "MixprecError", "compile",
    "OpCategory", "OptLevel", "Policy", "PolicyError", "ScaleConfig", "ScalerCheckpointError",
    "ScalerConfigError", "ScalerStateError", "SkipAwareLR", "TrainStep", "TrainStepError",
    "ExplainReport", "NonFiniteEvent", "ScaleHistory", "UnderflowReport", "explain",
    "grad_underflow", "scale_history", "watch_nonfinite",
    "Fp8Recipe", "Fp8Report", "fp8_report", "fp8_update", "to_fp8",
    "__version__", "autocast", "checkpoint_context", "custom_bwd", "custom_fwd", "default_dtype",
    "describe", "fully_shard", "load_checkpoint", "save_checkpoint",
    "float_function", "get_autocast_dtype", "get_autocast_policy", "half_function", "initialize",
    "is_autocast_enabled", "master_params", "promote_function", "scale_loss", "update_scale",
    "LowMemAdam", "LowMemAdamW", "LowMemSGD", "MemoryReport", "memory_report",
    "HealConfig", "HealMove", "Healer", "TuneReport", "tune_policy",
    "CpuMemory", "keep_cpu_memory",
]  # fmt: skip


def test_all_snapshot():
    assert sorted(mixprec.__all__) == sorted(EXPECTED)
    for name in mixprec.__all__:
        assert hasattr(mixprec, name), name


def test_import_does_not_pull_in_the_compiler():
    # torch._dynamo costs over a second to import; mixprec must not import it eagerly.
    code = "import sys, mixprec; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
