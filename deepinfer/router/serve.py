"""``deepinfer router``: load the workers' tokenizer, serve the router with uvicorn."""

from __future__ import annotations

import argparse
import logging

from .config import RouterConfig, add_router_args, router_config

log = logging.getLogger("deepinfer.router")


def run_router(config: RouterConfig) -> int:
    import uvicorn

    from ..loader import load_checkpoint
    from .app import Router

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    tokenizer = load_checkpoint(config.model, progress=False).tokenizer
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    app = Router(config, tokenizer).build_app()
    log.info("routing (%s) on http://%s:%d to %s", config.policy, config.host, config.port,
             ", ".join(config.all_workers))
    try:
        uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                      log_level=config.log_level, lifespan="on")).run()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    return run_router(router_config(args))


def add_router_parser(sub) -> None:
    r = sub.add_parser("router", help="KV-aware router in front of `deepinfer serve` workers")
    add_router_args(r)
    r.set_defaults(func=cmd_router)
