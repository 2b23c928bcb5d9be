"""Opt levels O0-O3: presets with reasons, master weights, and Apex's initialize/scale_loss."""

from mixprec.levels.initialize import initialize, master_params, scale_loss
from mixprec.levels.optimizer import AmpOptimizer
from mixprec.levels.presets import AmpOptions, OptLevel, describe

__all__ = [
    "AmpOptimizer",
    "AmpOptions",
    "OptLevel",
    "describe",
    "initialize",
    "master_params",
    "scale_loss",
]
