"""The LLM runner, above the CUDA layer: GGUF files, tokenizers and chat
templates, the model definitions and their lowering to kernel launches,
sessions and generation, and the text commands (``run``, ``chat``, ``info``).

>>> from ptxgen.llm import Model                                   # doctest: +SKIP
>>> model = Model.from_gguf("model.gguf")                          # doctest: +SKIP
>>> print(model.generate_text("The capital of France is").text)    # doctest: +SKIP
"""

from .generation import ContextOverflowError, SamplingSettings
from .gguf.file import GGUFError
from .model import GenerateResult, Model
from .session import Session

__all__ = ["Model", "Session", "SamplingSettings", "GenerateResult", "ContextOverflowError",
           "GGUFError"]
