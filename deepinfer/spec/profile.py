"""SPS(B) measured on the running engine, per context length, through the forward a verify
step really runs.

A step's cost depends on more than its token count: B = 1 runs the batched decode path, while
a verify span runs as a short prefill chunk after the cached prefix (a gather of the context,
a masked attention, matmuls with B rows instead of one), and both grow with the context. A
profile taken on an empty context is flat and under-prices verification, so the profile is
measured lazily, once per context bucket (powers of 4), on the first decoding request that
reaches it: its own pages and context, B = 1 as a decode, B > 1 as a span of dummy tokens
past its last token. Those positions lie beyond ``num_computed_tokens``, so they are
rolled back like a rejected draft's (their pages freed, their KV overwritten later). After that, the steps of one decoding
request refine their bucket's profile with their own times (``SpsProfile.observe``).
"""

from __future__ import annotations

import time

import torch

from ..kv.cache_manager import KVCacheManager
from ..model_runner import ModelRunner
from ..request import Request
from .verify_schedule import SpsProfile

SIZES = (1, 2, 3, 5, 9, 17, 33, 65)  # step tokens measured (up to the most a step verifies)
DENSE = 17  # step tokens up to this have a point of their own


def context_bucket(context: int) -> int:
    """Contexts below 512 share bucket 4, then one bucket per factor of 4 (512-2047: 5, ...)."""
    return max(context.bit_length(), 8) // 2


class SpsByContext:
    """SPS profiles per context bucket; ``fixed``: one given profile for every context."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_tokens: int,
                 fixed: SpsProfile | None = None, repeats: int = 3) -> None:
        self.runner, self.kv = runner, kv
        self.max_tokens = max_tokens
        self.sizes = [b for b in SIZES if b <= max_tokens] or [1]
        self.fixed = fixed
        self.repeats = repeats
        self.profiles: dict[int, SpsProfile] = {}

    def for_step(self, reqs: list[Request]) -> SpsProfile | None:
        """The profile for a step of decoding ``reqs`` (its longest context decides), measured
        now on that request if its bucket has none; None if its pages cannot hold a span."""
        if self.fixed is not None:
            return self.fixed
        req = max(reqs, key=lambda r: r.num_tokens)
        bucket = context_bucket(req.num_tokens)
        if bucket not in self.profiles:
            if not self.kv.allocate(req, self.sizes[-1]):
                return None
            self.profiles[bucket] = self._measure(req)
            self.kv.rollback(req, 1)  # back to this step's decode token
        return self.profiles[bucket]

    def observe(self, req: Request, b: int, seconds: float) -> None:
        """A step of ``req`` alone with ``b`` tokens took ``seconds``: its bucket's measured
        profile follows it (a given profile stays as given)."""
        prof = self.profiles.get(context_bucket(req.num_tokens))
        if self.fixed is None and prof is not None:
            prof.observe(b, seconds)

    def _measure(self, req: Request) -> SpsProfile:
        """Each size's time relative to the 1-token step of the same round, the lowest ratio
        over ``repeats`` rounds (after one warm-up round), times the best 1-token time: a size
        is compared with a step taken moments apart, and the lowest ratio is kept because the
        two errors differ. A size priced too high is never picked, so no step corrects it (a
        burst of load once priced every span of 3 or more tokens at 2.2x a decode for good),
        while one priced too low is picked and its observed steps correct it
        (``SpsProfile.observe``)."""
        rounds = [[self._time(req, b) for b in self.sizes] for _ in range(self.repeats + 1)][1:]
        one = min(r[0] for r in rounds)
        sparse = SpsProfile(self.sizes, [1.0 / (one * min(r[i] / r[0] for r in rounds))
                                         for i in range(len(self.sizes))])
        # every step size up to DENSE gets its own point (interpolated for now), so each size
        # a plan picks is refined by the steps that run it
        dense = list(range(1, min(self.max_tokens, DENSE) + 1)) + [b for b in self.sizes if b > DENSE]
        return SpsProfile(dense, [sparse(b) for b in dense])

    def _time(self, req: Request, b: int) -> float:
        """Seconds of one step of ``req`` with ``b`` tokens (its last one, repeated)."""
        req.output_token_ids += [req.all_token_ids[-1]] * (b - 1)
        try:
            sync(self.runner.device)
            t0 = time.perf_counter()
            self.runner.forward_spans([(req, b)], {req: b} if b > 1 else {})
            sync(self.runner.device)
            return time.perf_counter() - t0
        finally:
            if b > 1:
                del req.output_token_ids[-(b - 1):]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
