"""Graph-level AMP: the policy applied to whole graphs captured by ``torch.compile``."""

from mixprec.graph.backend import AmpBackend, compile
from mixprec.graph.casts import CAST_MODES, CastReport

__all__ = ["CAST_MODES", "AmpBackend", "CastReport", "compile"]
