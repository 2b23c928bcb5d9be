"""The single source of mixprec's version string."""

__version__ = "0.7.0"
