"""Kernel families written with the ptxgen DSL.

Each module holds one family: a frozen spec, ``build(spec)`` returning a
:class:`ptxgen.Module`, its launch geometry, a numpy reference, and the
canonical specs it registers for the CLI and the golden tests.
"""

from . import reduce, vector_add  # noqa: F401  (registration side effects)

__all__ = ["vector_add", "reduce"]
