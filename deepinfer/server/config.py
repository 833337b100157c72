"""Server options (apart from the engine's): address, auth, back-pressure, names.

Kept free of FastAPI/uvicorn imports so the CLI can build its parser cheaply.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("deepinfer.server")

# generation_config.json fields that become request defaults (HF name -> request field)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "max_new_tokens": "max_tokens"}
ROLES = ("both", "prefill", "decode")
PD_TRANSFERS = ("store", "direct")  # how a prompt's KV reaches the decode worker (server/pd.py)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token required on every endpoint but /health
    served_model_name: str | None = None  # default: the checkpoint's name
    # Back-pressure: at most ``max_num_seqs`` requests run and ``max_queue`` more wait; a request
    # beyond that is answered 429 with Retry-After instead of being queued without bound.
    max_queue: int = 256
    retry_after_s: int = 1
    # Chat prompts reuse the generated token ids of recent replies (prefix-stable encoding);
    # this bounds the tokens kept for that (prompt + reply ids of recent responses).
    reply_cache_tokens: int = 4_000_000
    # Page hashes of recently finished requests, to tell "evicted" from "never cached".
    recent_pages: int = 65_536
    enable_cache_explain: bool = True  # POST /v1/cache/explain
    # The explainer may say "cached under another cache_salt" (a hint about other tenants).
    explain_cross_tenant: bool = False
    # Request bodies: at most this many bytes (413) and this JSON nesting depth (400).
    max_body_bytes: int = 16 * 2**20
    shutdown_timeout_s: float = 30.0  # graceful shutdown: wait this long for requests to drain
    log_level: str = "info"
    tool_call_parser: str | None = None  # a family of tools/parsers.py; None: from the template
    chat_template: str | None = None  # a Jinja template (text) replacing the checkpoint's
    # Request defaults: "auto" (the model's generation_config.json), "vllm" (built-in
    # defaults) or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Prefill/decode disaggregation (server/pd.py): "both" (co-located), "prefill" (computes
    # prompts into the shared store, hands requests to ``decode_workers``), "decode".
    role: str = "both"
    decode_workers: list[str] = field(default_factory=list)  # base URLs, round-robin
    # How the KV reaches the decode worker: "store" (through --kv-store) or "direct" (read from
    # the prefill worker's memory over the transfer engine: kv/transfer.py; store as fallback).
    pd_transfer: str = "store"
    pd_transfer_host: str = "127.0.0.1"  # the address peers reach this worker's transfer engine at
    pd_transfer_protocol: str = "tcp"  # "tcp" or "rdma"
    pd_transfer_device: str = ""  # the RDMA NIC (e.g. mlx5_0); empty for tcp
    pd_transfer_buffer_mb: int = 256  # the registered buffer pages are exported from / read into
    pd_transfer_ttl_s: float = 30.0  # exported or pulled pages nobody asked for are freed then
    pd_transfer_timeout_s: float = 10.0  # a pull taking longer falls back to the store
    # KV events (``kv_events.py``, for a router's prefix index): events kept for subscribers;
    # 0 turns the endpoints off.
    kv_events_buffer: int = 4096

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.decode_workers and self.role != "prefill":
            raise ValueError("--decode-worker is for --role prefill")
        if self.pd_transfer not in PD_TRANSFERS:
            raise ValueError(f"pd_transfer must be one of {', '.join(PD_TRANSFERS)}, got "
                             f"{self.pd_transfer!r}")
        if self.pd_transfer == "direct" and self.role == "both":
            raise ValueError("--pd-transfer direct is for --role prefill and --role decode")
        if self.pd_transfer_buffer_mb < 1 or self.pd_transfer_ttl_s <= 0 \
                or self.pd_transfer_timeout_s <= 0:
            raise ValueError("--pd-transfer-buffer-mb, --pd-transfer-ttl and "
                             "--pd-transfer-timeout must be > 0")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.kv_events_buffer < 0:
            raise ValueError("kv_events_buffer must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("--host", default=d.host, help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint except /health "
                        "(default: $DEEPINFER_API_KEY, else no auth)")
    p.add_argument("--served-model-name", default=None,
                   help="model name shown by /v1/models and accepted in requests")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests allowed to wait beyond --max-num-seqs running ones; more get 429")
    p.add_argument("--no-cache-explain", action="store_true",
                   help="disable POST /v1/cache/explain (it reveals what other requests cached)")
    p.add_argument("--explain-cross-tenant", action="store_true",
                   help="let the cache explainer say when the tokens are cached under another "
                        "cache_salt (off: it describes only the requesting tenant's cache)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body accepted (larger: 413)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds to let running requests finish on shutdown")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--role", default=d.role, choices=ROLES,
                   help="prefill/decode disaggregation: prefill (compute prompts into the "
                        "shared --kv-store and hand them over), decode (serve with hits from "
                        "the store), both (co-located, the default)")
    p.add_argument("--decode-worker", action="append", default=[], metavar="URL",
                   help="--role prefill: decode worker to forward requests to after their "
                        "prefill (repeatable: round-robin)")
    p.add_argument("--pd-transfer", default=d.pd_transfer, choices=PD_TRANSFERS,
                   help="--role prefill|decode: how the prompt's KV reaches the decode worker: "
                        "store (through --kv-store, the default) or direct (the decode worker "
                        "reads it from the prefill worker's memory over the Mooncake transfer "
                        "engine; the store is the fallback). Both workers need the same value")
    p.add_argument("--pd-transfer-host", default=d.pd_transfer_host,
                   help="address other workers reach this one's transfer engine at")
    p.add_argument("--pd-transfer-protocol", default=d.pd_transfer_protocol,
                   choices=("tcp", "rdma"), help="transfer engine transport")
    p.add_argument("--pd-transfer-device", default=d.pd_transfer_device,
                   help="RDMA NIC for --pd-transfer-protocol rdma (e.g. mlx5_0)")
    p.add_argument("--pd-transfer-buffer-mb", type=int, default=d.pd_transfer_buffer_mb,
                   help="registered buffer for exported (prefill) or pulled (decode) pages")
    p.add_argument("--pd-transfer-ttl", type=float, default=d.pd_transfer_ttl_s,
                   help="seconds exported or pulled pages are kept if nobody claims them")
    p.add_argument("--pd-transfer-timeout", type=float, default=d.pd_transfer_timeout_s,
                   help="seconds a decode worker waits for a pull before taking the store route")
    from .tools.parsers import DSML_PARSER, PARSERS

    p.add_argument("--chat-template", default=None,
                   help="chat template replacing the checkpoint's: a file, or the template text")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", *sorted([*PARSERS, DSML_PARSER])],
                   help="how replies are parsed into tool calls (default: from the chat template; "
                        f"DeepSeek-V4 checkpoints: {DSML_PARSER}, through deepseek-recipe)")
    p.add_argument("--generation-config", default=d.generation_config,
                   help="request defaults (temperature, top_p, top_k, min_p, max_new_tokens): "
                        "auto (the model's generation_config.json), vllm (built-in defaults), or "
                        "a folder with a generation_config.json")
    p.add_argument("--kv-events-buffer", type=int, default=d.kv_events_buffer,
                   help="KV events (pages stored/removed) kept for routers polling GET /kv/events; "
                        "a router further behind resyncs from GET /kv/snapshot (0: no events)")


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a file, else the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def generation_defaults(source: str, model_path: Path | None) -> dict:
    """Request defaults from a generation_config.json (see ``ServerConfig.generation_config``)."""
    if source == "vllm":
        return {}
    folder = model_path if source == "auto" else Path(source).expanduser()
    file = folder / "generation_config.json" if folder is not None else None
    if file is None or not file.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {folder}")
        return {}
    cfg = json.loads(file.read_text())
    out = {ours: cfg[hf] for hf, ours in GENERATION_DEFAULTS.items() if cfg.get(hf) is not None}
    if cfg.get("repetition_penalty") not in (None, 1, 1.0):
        log.warning("generation config: repetition_penalty %s is not applied by default",
                    cfg["repetition_penalty"])
    return out


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                        served_model_name=args.served_model_name, max_queue=args.max_queue,
                        enable_cache_explain=not args.no_cache_explain,
                        explain_cross_tenant=args.explain_cross_tenant,
                        max_body_bytes=args.max_body_bytes,
                        shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level,
                        tool_call_parser=args.tool_call_parser,
                        chat_template=read_chat_template(args.chat_template),
                        generation_config=args.generation_config, role=args.role,
                        decode_workers=args.decode_worker, pd_transfer=args.pd_transfer,
                        pd_transfer_host=args.pd_transfer_host,
                        pd_transfer_protocol=args.pd_transfer_protocol,
                        pd_transfer_device=args.pd_transfer_device,
                        pd_transfer_buffer_mb=args.pd_transfer_buffer_mb,
                        pd_transfer_ttl_s=args.pd_transfer_ttl,
                        pd_transfer_timeout_s=args.pd_transfer_timeout,
                        kv_events_buffer=args.kv_events_buffer)
