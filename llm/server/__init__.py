"""``python -m ptxgen serve``: OpenAI's HTTP API over the batched engine.

:mod:`.protocol` holds the request models and the error object, :mod:`.app`
the routes (a Starlette app served by uvicorn), :mod:`.metrics` the
Prometheus metrics and :mod:`.cli` the command.
"""

from .app import create_app

__all__ = ["create_app"]
