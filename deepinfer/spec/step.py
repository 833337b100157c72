"""The engine's side of speculative decoding: building the decoder from its config, and
emitting a step's verified tokens one at a time, so every stop condition is checked per
token exactly as for plainly sampled ones."""

from __future__ import annotations

from collections.abc import Callable

from ..config import EngineConfig
from ..kv.cache_manager import KVCacheManager
from ..loader import Checkpoint
from ..model_runner import ModelRunner
from ..request import Request
from .auto_drafter import AutoDrafter
from .calibration import Calibrator
from .config import SpeculativeConfig
from .decoder import SpeculativeDecoder
from .draft_model import build_draft_model
from .drafters import DraftSource, NgramDrafter, SuffixDrafter, TokenDrafter
from .profile import SpsByContext
from .verify_schedule import SpsProfile


def build_decoder(config: EngineConfig, ckpt: Checkpoint, runner: ModelRunner, kv: KVCacheManager,
                  span: int, max_model_len: int) -> SpeculativeDecoder:
    """The decoder of ``config.speculative_config`` with its draft source; scheduled mode takes
    the given steps/s profile or measures one per context as requests reach it."""
    sc = config.speculative_config
    assert sc is not None and sc.method != "none"
    calibrator = Calibrator(sc.calibration_window)
    source: DraftSource
    if sc.method == "draft_model":
        source, drafts_from = build_draft_model(sc, config, ckpt, runner, max_model_len), None
    else:
        source, drafts_from = weight_free_source(sc, calibrator)
    sps = None
    if sc.scheduled:
        fixed = (None if sc.sps_tokens is None else
                 SpsProfile(list(sc.sps_tokens), list(sc.sps_steps_per_s or ())))
        sps = SpsByContext(runner, kv, min(sc.num_tokens + 1, span), fixed)
    return SpeculativeDecoder(sc, source, drafts_from or [source.name], calibrator, runner, kv, span,
                              max_model_len, sps)


def weight_free_source(sc: SpeculativeConfig, calibrator: Calibrator
                       ) -> tuple[TokenDrafter, list[str] | None]:
    """The draft source of a weight-free method, and (``auto``) the sources its drafts name."""
    if sc.method == "suffix":
        return SuffixDrafter(sc.ngram_min, sc.ngram_max), None
    if sc.method == "auto":
        parts: list[TokenDrafter] = [NgramDrafter(sc.ngram_min, sc.ngram_max),
                                     SuffixDrafter(sc.ngram_min, sc.ngram_max)]
        return AutoDrafter(parts, calibrator), [p.name for p in parts]  # drafts carry their own name
    assert sc.method == "ngram"
    return NgramDrafter(sc.ngram_min, sc.ngram_max), None


def emit_verified(verified: list[tuple[Request, list[int]]], kv: KVCacheManager,
                  check_stop: Callable[[Request], None], now: float) -> list[Request]:
    """Append each request's verified tokens up to the one that stops it and free the pages
    its rejected tokens took; returns the requests (finished ones with ``finish_time`` set)."""
    out = []
    for req, tokens in verified:
        for i, tok in enumerate(tokens):
            if i:  # the token before was an accepted draft token: its KV is in the pages
                req.num_computed_tokens += 1
                kv.cache_pages(req)
            req.output_token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            check_stop(req)
            if req.is_finished:
                req.finish_time = now
                break
        kv.rollback(req)  # the rejected tokens' pages (and ring pages) go back at once
        out.append(req)
    return out
