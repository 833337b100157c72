"""SpeculativeDecoder: drafts, decides what to verify, runs the step, verifies.

The engine hands it a scheduled batch. Decoding requests get a draft from the source; fixed-k
verifies all of it, scheduled mode asks Algorithm 1 (``verify_schedule.py``) with calibrated
survival probabilities. The drafts are appended to their requests' tokens only for the forward
(the runner reads tokens from the request) and removed right after, so nothing else ever sees
a draft token: the engine appends the accepted ones, the KV cache manager caches pages only
up to the accepted length, and the pages (and ring pages) that only rejected tokens' KV took
go back to their pools in the same step (``KVCacheManager.rollback``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kv.cache_manager import KVCacheManager
from ..model_runner import ModelRunner
from ..request import Request
from .calibration import Calibrator
from .config import SpeculativeConfig
from .counters import SpecCounters
from .drafters import Draft, DraftSource
from .verify import verify
from .profile import SpsByContext, sync
from .verify_schedule import plan_verify


@dataclass
class SpecStep:
    """A step's results: requests that produce one token the usual way, with their logits rows
    (for the engine's sampler), and verified requests with the tokens they emit (accepted draft
    tokens, then the target's token)."""

    sampled: list[Request]
    logits: torch.Tensor | None
    verified: list[tuple[Request, list[int]]]


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, source: DraftSource, drafts_from: list[str],
                 calibrator: Calibrator, runner: ModelRunner, kv: KVCacheManager, max_span: int,
                 max_model_len: int, sps: SpsByContext | None) -> None:
        """``drafts_from``: the sources whose names the drafts carry (``auto``: several), in the
        metrics from the start; a source named otherwise is counted from its first draft."""
        self.config = config
        self.runner = runner
        self.kv = kv
        self.k = min(config.num_tokens, max_span - 1)  # a verify span fits one prefill chunk
        self.max_model_len = max_model_len
        self.source = source
        self.calibrator = calibrator
        self.sps = sps
        self.totals = {name: SpecCounters() for name in drafts_from}

    # ------------------------------------------------------------------ drafting
    def _room(self, req: Request) -> int:
        """Draft tokens ``req`` may verify now: each step emits them plus one more token.
        Requests whose sampling reads more than the logits (logprobs, bias, penalties, a
        grammar) are not speculated; under ``auto`` sampled ones neither, since a weight-free
        draft of a sampled reply is rarely accepted (README "Speculative decoding")."""
        p = req.params
        if p.logprobs is not None or p.logit_bias or p.penalized or req.grammar is not None:
            return 0
        if self.config.method == "auto" and not p.greedy:
            return 0
        return max(0, min(self.k, p.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _drafts(self, items: list[tuple[Request, int]], budget: int) -> dict[Request, Draft]:
        # not a request whose KV is still streaming in (``kv_load`` set at step time): a page
        # failing its check after the step drops the step's token, and a verified span could
        # not be taken back
        asks = [(req, self._room(req)) for req, n in items
                if n == 1 and req.num_computed_tokens == req.num_tokens - 1 and req.kv_load is None]
        asks = [(req, room) for req, room in asks if room > 0]
        drafts: dict[Request, Draft] = {}
        for (req, _), d in zip(asks, self.source.propose_batch(asks)):
            req.spec.source = self.source.name
            if d.tokens:
                req.spec.drafted += len(d.tokens)
                self.totals.setdefault(d.source, SpecCounters()).drafted += len(d.tokens)
                drafts[req] = d
        reqs = list(drafts)
        if self.sps is None or not self.config.scheduled or not reqs:
            counts = [len(drafts[r].tokens) for r in reqs]
        elif (sps := self.sps.for_step(reqs)) is None:  # no room to profile this context
            counts = [0] * len(reqs)
        else:
            survival = [self.calibrator.survival(drafts[r].source, drafts[r].features) for r in reqs]
            base = sum(n for _, n in items) - len(reqs)
            counts = plan_verify(survival, sps, base)
        chosen: dict[Request, Draft] = {}
        for req, c in zip(reqs, counts):
            c = min(c, budget)
            if c > 0 and self.kv.allocate(req, 1 + c):
                chosen[req] = drafts[req].head(c)
                budget -= c
        return chosen

    # ------------------------------------------------------------------ step
    def forward(self, items: list[tuple[Request, int]], budget: int) -> SpecStep:
        """Run the scheduled batch with verify spans; ``budget``: tokens the step may add."""
        drafts = self._drafts(items, budget)
        run = [(r, n + len(drafts[r].tokens)) if r in drafts else (r, n) for r, n in items]
        for r, d in drafts.items():
            r.output_token_ids += d.tokens
        t0 = time.perf_counter()
        try:
            sampled, logits = self.runner.forward_spans(
                run, {r: len(d.tokens) + 1 for r, d in drafts.items()})
            if self.sps is not None and len(run) == 1 and items[0][1] == 1 and items[0][0].kv_load is None:
                # one decoding request (not one waiting on a stream: that step times the load)
                sync(self.runner.device)
                self.sps.observe(run[0][0], run[0][1], time.perf_counter() - t0)
        except Exception:
            for r in drafts:  # the engine runs the batch plain: one token each
                self.kv.rollback(r, 1)
            raise
        finally:
            for r, d in drafts.items():
                del r.output_token_ids[-len(d.tokens):]
        plain = [(r, rows) for r, rows in zip(sampled, logits) if r not in drafts]
        verified: list[tuple[Request, list[int]]] = []
        for r, rows in zip(sampled, logits):
            d = drafts.get(r)
            if d is None:
                continue
            tokens = verify(rows, d.tokens, r.params, self.runner.request_generator(r), d.probs)
            accepted = len(tokens) - 1
            self.calibrator.update(d.source, d.features, accepted)
            for c in (r.spec, self.totals.setdefault(d.source, SpecCounters())):
                c.verified += len(d.tokens)
                c.accepted += accepted
                c.steps += 1
            verified.append((r, tokens))
        return SpecStep([r for r, _ in plain],
                        torch.cat([rows for _, rows in plain]) if plain else None, verified)

    def observe(self, req: Request) -> None:
        """A request finished: shared draft sources learn its tokens, the draft model frees
        its KV."""
        self.source.finished(req)

    def stats(self) -> dict[str, dict[str, float]]:
        """Counters and calibration error by draft source."""
        t = self.totals
        return {
            "spec_drafted_tokens_total": {s: c.drafted for s, c in t.items()},
            "spec_verified_tokens_total": {s: c.verified for s, c in t.items()},
            "spec_accepted_tokens_total": {s: c.accepted for s, c in t.items()},
            "spec_verify_steps_total": {s: c.steps for s, c in t.items()},
            "spec_mean_accepted_tokens": {s: c.mean_accepted for s, c in t.items()},
            "spec_calibration_ece": {s: self.calibrator.ece(s) for s in t},
        }
