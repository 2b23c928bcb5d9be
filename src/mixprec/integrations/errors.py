"""The error every framework integration raises (re-exported by `mixprec.integrations.engine`)."""

from __future__ import annotations

from mixprec.errors import MixprecError

__all__ = ["IntegrationError"]


class IntegrationError(MixprecError, ValueError):
    """A framework integration was set up in a way that cannot work (the message says the fix)."""
