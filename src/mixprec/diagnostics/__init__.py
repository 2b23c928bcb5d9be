"""Diagnostics: what ran in which precision, where values became non-finite, the loss scale.

- `explain`: one forward under the policy, call by call: module, op, rule and reason, dtypes,
  casts, ping-pong between fp32 and low precision, share of matmul FLOPs in low precision.
- `watch_nonfinite`: the first module, phase and op where inf/NaN appeared, flags on the device.
- `grad_underflow`: gradient elements lost to fp16's range at the current scale and at 2x.
- `scale_history`: the GradScaler's scale per update and its skipped steps (table, PNG).
- `AmpMetrics`: the loss scale, skipped steps and inf/NaN losses as named metrics for loggers,
  read off the device in batches (one sync per batch).
"""

from mixprec.diagnostics.explain import ExplainReport, explain
from mixprec.diagnostics.metrics import AmpMetrics
from mixprec.diagnostics.telemetry import (
    ScaleHistory,
    UnderflowReport,
    grad_underflow,
    scale_history,
)
from mixprec.diagnostics.watch import NonFiniteEvent, watch_nonfinite

__all__ = [
    "AmpMetrics",
    "ExplainReport",
    "NonFiniteEvent",
    "ScaleHistory",
    "UnderflowReport",
    "explain",
    "grad_underflow",
    "scale_history",
    "watch_nonfinite",
]
