"""The ptxgen version (PTX headers and the module cache key carry it)."""

__version__ = "0.1.0"
