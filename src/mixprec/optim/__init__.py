"""Low-memory training state: optimizers with bf16 weights that keep small updates (stochastic
rounding, Kahan compensation) and 8-bit or bf16 states, and `memory_report`."""

from mixprec.optim.lowmem import (
    STATES,
    WEIGHTS,
    LowMemAdam,
    LowMemAdamW,
    LowMemOptimizer,
    LowMemSGD,
    converted,
)
from mixprec.optim.report import COMPONENTS, MemoryReport, memory_report

__all__ = [
    "COMPONENTS",
    "STATES",
    "WEIGHTS",
    "LowMemAdam",
    "LowMemAdamW",
    "LowMemOptimizer",
    "LowMemSGD",
    "MemoryReport",
    "converted",
    "memory_report",
]
