"""Model definitions, one file per decoder family, each a short
:class:`~.base.Architecture` over shared blocks.

Adding a family: a file here with its class (GGUF names, conventions, and
``forward``/``layer`` where they differ from the base), its entry in
:data:`ARCHITECTURES`, its conventions in the loader's checks
(:mod:`ptxgen.llm.gguf.file`), a ``gguf_synth`` writer case and a test
against the float64 reference.
"""

from __future__ import annotations

from .base import Architecture
from .gemma3 import Gemma3
from .llama import Llama
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen3moe import Qwen3Moe

__all__ = ["Architecture", "ARCHITECTURES", "architecture_of"]

#: ``general.architecture`` -> definition
ARCHITECTURES: dict[str, type] = {n: cls for cls in (Llama, Qwen2, Qwen3, Gemma3, Qwen3Moe)
                                  for n in cls.gguf_names}


def architecture_of(file) -> Architecture:
    """The definition of ``file``'s architecture (a loaded model file)."""
    try:
        cls = ARCHITECTURES[file.hparams.arch]
    except KeyError:
        raise ValueError(f"architecture {file.hparams.arch!r} has no model definition "
                         f"(supported: {', '.join(ARCHITECTURES)})") from None
    return cls(file)
