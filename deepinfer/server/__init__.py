"""OpenAI/DeepSeek-compatible HTTP server (FastAPI + uvicorn) over the engine thread.

``deepinfer serve`` runs it; ``BackgroundServer`` runs one in a thread (tests, benchmarks).
Modules: ``config`` (options), ``protocol`` (request parsing; ``api_error``, ``json_body``,
``request_fields``, ``chat_messages``: errors and checks), ``prompts`` (prefix-stable chat
encoding), ``detokenize`` (streaming text), ``engine_thread`` (the engine's thread),
``async_engine`` (requests on it), ``metrics`` (Prometheus text), ``app`` (endpoints;
``openai_replies``, ``delta_queue``: answers, a request's deltas), ``serve`` (uvicorn,
``BackgroundServer``). See docs/server.md. FastAPI is imported only when
``app`` or ``serve`` is.
"""

from .config import ServerConfig

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "run_server"]


def __getattr__(name: str):
    if name == "create_app":
        from . import app

        return app.create_app
    if name in ("BackgroundServer", "run_server"):
        from . import serve

        return getattr(serve, name)
    raise AttributeError(name)
