"""Optional dependencies (matplotlib, tqdm, the extras), imported on first use with a clear error.

This module sits below every other part of mixprec (it imports only the error base class), so
the core (diagnostics) and the bench layer can both draw plots without importing each other.

mixprec is installed from its checkout, not from a package index, so the errors name the extras
as ``pip install -e '.[plots,data]'`` (run in the checkout) and the packages they bring.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from mixprec.errors import MixprecError

__all__ = [
    "MissingDependencyError",
    "install_hint",
    "require_extras",
    "require_matplotlib",
    "tqdm_or_none",
]


class MissingDependencyError(MixprecError, ImportError):
    """An optional dependency is not installed (the message names the extra that installs it)."""


def install_hint(extras: Sequence[str], packages: Sequence[str]) -> str:
    """How to install `extras` (from the mixprec checkout) or, alone, the `packages` they bring."""
    return (
        f"pip install -e '.[{','.join(extras)}]' in the mixprec checkout "
        f"(or pip install {' '.join(packages)})"
    )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module set to None
        return False


def require_extras(feature: str, needs: Sequence[tuple[str, str, str]]) -> None:
    """Check, without importing them, every module `feature` needs; name all that are missing.

    Args:
        feature: what needs them, for the message (``"mixprec train --tensorboard"``).
        needs: ``(module, pip package, mixprec extra)`` for each dependency.

    Raises:
        MissingDependencyError: one or more modules are not installed; the message lists every
            extra the feature needs (not only the missing ones) and the packages missing.
    """
    missing = [(pkg, extra) for module, pkg, extra in needs if not _installed(module)]
    if not missing:
        return
    extras = list(dict.fromkeys(extra for _, _, extra in needs))
    raise MissingDependencyError(
        f"{feature} needs the extras {', '.join(extras)}; not installed: "
        f"{', '.join(pkg for pkg, _ in missing)}. Install them with "
        f"{install_hint(extras, [pkg for pkg, _ in missing])}."
    )


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` with a headless backend, or an error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingDependencyError(
            f"plotting needs matplotlib: {install_hint(['plots'], ['matplotlib'])}."
        ) from err
    return plt


def tqdm_or_none() -> Any:
    """The ``tqdm`` class, or None when it is not installed (callers fall back to plain lines)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
