"""Running the HTTP app: ``deepinfer serve`` (uvicorn in the foreground, drained on
SIGINT/SIGTERM) and ``BackgroundServer`` (a loopback server in a thread)."""

from __future__ import annotations

import logging
import socket
import threading
import time

from fastapi import FastAPI

from ..engine import LLMEngine
from .app import Server, create_app
from .async_engine import AsyncEngine
from .config import ServerConfig

log = logging.getLogger("deepinfer.server")


def _uvicorn_config(app: FastAPI, config: ServerConfig):
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          lifespan="on", timeout_graceful_shutdown=config.shutdown_timeout_s)


def run_server(engine_config, config: ServerConfig) -> int:
    """Build the engine and serve until SIGINT/SIGTERM (then drain and stop)."""
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(engine_config)
    app = create_app(engine, config)
    log.info("serving %s on http://%s:%d (max_model_len %d)", app.state.server.model_name,
             config.host, config.port, engine.max_model_len)
    try:
        uvicorn.Server(_uvicorn_config(app, config)).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0


class BackgroundServer:
    """A server on a loopback port in a background thread (tests, benchmarks, notebooks)."""

    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None) -> None:
        import uvicorn

        config = config or ServerConfig(port=0, log_level="warning")
        self.app = create_app(engine, config)
        self.server_obj: Server = self.app.state.server
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((config.host, config.port))
        self.host, self.port = self._sock.getsockname()[:2]
        self._uvicorn = uvicorn.Server(_uvicorn_config(self.app, config))
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._sock]},
                                        name="deepinfer-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def async_engine(self) -> AsyncEngine:
        return self.server_obj.async_engine

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        t0 = time.monotonic()
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
