"""Optional dependencies (matplotlib, tqdm), imported on first use with a clear error.

This module sits below every other part of mixprec (it imports only the error base class), so
the core (diagnostics) and the bench layer can both draw plots without importing each other.
"""

from __future__ import annotations

from typing import Any

from mixprec.errors import MixprecError

__all__ = ["MissingDependencyError", "require_matplotlib", "tqdm_or_none"]


class MissingDependencyError(MixprecError, ImportError):
    """An optional dependency is not installed (the message names the extra that installs it)."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` with a headless backend, or an error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingDependencyError(
            "plotting needs matplotlib: pip install 'mixprec[plots]' (or pip install matplotlib)."
        ) from err
    return plt


def tqdm_or_none() -> Any:
    """The ``tqdm`` class, or None when it is not installed (callers fall back to plain lines)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
