"""The LLM runner, above the CUDA layer: GGUF files, tokenizers and chat
templates, the model definitions and their lowering to kernel launches,
sessions and generation, and the text commands (``run``, ``chat``, ``info``).

>>> from ptxgen.llm import Model                                   # doctest: +SKIP
>>> model = Model.from_gguf("model.gguf")                          # doctest: +SKIP
>>> print(model.generate_text("The capital of France is").text)    # doctest: +SKIP
"""

import importlib

# where each public name lives; imported on first use, so that the commands
# (``ptxgen.llm.cli``) start without loading the kernels and the driver
_EXPORTS = {"Model": ".model", "GenerateResult": ".model", "Session": ".session",
            "SamplingSettings": ".generation", "ContextOverflowError": ".generation",
            "GGUFError": ".gguf.file"}

__all__ = ["Model", "Session", "SamplingSettings", "GenerateResult", "ContextOverflowError",
           "GGUFError"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
