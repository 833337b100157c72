"""OpenAI/DeepSeek-compatible HTTP server (FastAPI + uvicorn) over the engine thread.

``deepinfer serve`` runs it; ``BackgroundServer`` runs one in a thread (tests, benchmarks).
Modules: ``config`` (options), ``protocol`` (request validation, error bodies),
``prompts`` (prefix-stable chat encoding), ``detokenize`` (streaming text),
``async_engine`` (the engine thread), ``metrics`` (Prometheus text), ``app`` (endpoints).
See docs/server.md. FastAPI is imported only when ``app`` is.
"""

from .config import ServerConfig

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "run_server"]


def __getattr__(name: str):
    if name in ("BackgroundServer", "create_app", "run_server"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
