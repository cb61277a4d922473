"""The errors a GGUF file raises: one line naming the file and what was wrong."""

from __future__ import annotations

__all__ = ["GGUFError", "GGUFMetadataError"]


class GGUFError(ValueError):
    """A GGUF file that cannot be used, and why (the key or tensor at fault)."""


class GGUFMetadataError(GGUFError):
    """A file that cannot be read as GGUF: not one, truncated, or a header,
    metadata value or tensor info that is malformed, out of bounds or of the
    wrong type."""
