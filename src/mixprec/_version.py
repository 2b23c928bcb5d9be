"""The single source of mixprec's version string."""

__version__ = "0.6.0"
