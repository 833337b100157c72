"""Accuracy cost of a lossy KV tier, measured through the engine, teacher-forced.

``tier_scored_logits`` scores token sequences (e.g. lossless greedy generations) twice:

* reference: one prefill of each whole sequence, KV computed and kept losslessly in L1;
* tier: the sequence page by page; for the page starting at token ``k * page_size``, the KV
  of every earlier page is loaded back from the engine's lower tier (where it was evicted,
  i.e. encoded with that tier's codec, from the reference KV) and the page's own tokens are
  computed live, exactly as for a request whose cached prefix comes from that tier.

``prefix_tier_logits`` is the other realistic case: only a prompt's KV comes back from the
tier (a cache hit), and the continuation is computed live, teacher-forced.

Teacher forcing means every position sees the same (reference) tokens, so one early
divergence does not cascade into the rest of the sequence. ``compare`` then gives the share
of positions whose argmax agrees and the perplexity of the sequences' next tokens under both.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.engine import LLMEngine


def tier_scored_logits(engine: LLMEngine, seqs: list[list[int]], start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(reference, tier) logits of positions ``[start, len(seq) - 1)`` of each sequence (the
    logits at position t predict token t + 1). ``engine`` is an idle ``LLMEngine`` with a lower
    tier (L2, or L3 without L2) large enough for the sequences and an empty cache."""
    ps = engine.config.page_size
    full = engine.score(seqs)
    # Sequences sharing a prefix join the pages another one computes in the same call (L1,
    # lossless); a hit reaching past ``start`` means the cache was not empty.
    if any(cached > start for _, cached in full):
        raise ValueError("tier_scored_logits needs an empty cache")
    ref = [logits[start - cached : len(s) - 1 - cached] for (logits, cached), s in zip(full, seqs)]
    engine.kv.evict()  # every page goes down to the tier, encoded with its codec
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for k in range(start // ps, max((len(s) - 2) // ps for s in seqs) + 1):
        batch, idx = [], []
        for i, s in enumerate(seqs):
            end = min((k + 1) * ps, len(s) - 1)
            if end > max(k * ps, start):
                batch.append(s[:end])
                idx.append(i)
        for i, (logits, cached) in zip(idx, engine.score(batch)):
            if cached != k * ps:
                raise RuntimeError(f"expected {k * ps} tokens from the tier, got {cached}")
            out[i].append(logits[max(start - k * ps, 0) :])
        engine.kv.evict()  # the live page goes back out; its tier copy (from the reference) stays
    return ref, [torch.cat(o) for o in out]


def prefix_tier_logits(engine: LLMEngine, prompts: list[list[int]], seqs: list[list[int]]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(reference, tier) logits of positions ``[len(prompt) - 1, len(seq) - 1)``: the prompt's
    whole pages loaded back from the tier, the rest of ``seq`` (which starts with the prompt)
    computed live. Same engine requirements as ``tier_scored_logits``."""
    ps = engine.config.page_size
    ref = engine.score(seqs, cache_salt="lossless-reference")  # a namespace of its own
    engine.score(prompts)
    engine.kv.evict()
    tier = engine.score(seqs)
    out_r, out_t = [], []
    for (r, _), (t, cached), p, s in zip(ref, tier, prompts, seqs):
        if cached != (len(p) // ps) * ps:
            raise RuntimeError(f"expected the prompt's {len(p) // ps} pages from the tier, got {cached} tokens")
        out_r.append(r[len(p) - 1 : len(s) - 1])
        out_t.append(t[len(p) - 1 - cached : len(s) - 1 - cached])
    engine.kv.evict()
    return out_r, out_t


def compare(ref: list[torch.Tensor], tier: list[torch.Tensor], seqs: list[list[int]],
            start: int | list[int]) -> dict:
    """Argmax agreement and next-token perplexity of ``seq[start+1:]`` under both logits."""
    agree = total = 0
    nll_ref = nll_tier = 0.0
    starts = start if isinstance(start, list) else [start] * len(seqs)
    for r, t, s, st in zip(ref, tier, seqs, starts):
        target = torch.tensor(s[st + 1 :])
        assert r.shape == t.shape and len(target) == r.shape[0]
        agree += int((r.argmax(-1) == t.argmax(-1)).sum())
        total += len(target)
        nll_ref += float(torch.nn.functional.cross_entropy(r.float(), target, reduction="sum"))
        nll_tier += float(torch.nn.functional.cross_entropy(t.float(), target, reduction="sum"))
    ppl_ref, ppl_tier = math.exp(nll_ref / total), math.exp(nll_tier / total)
    return {"positions": total, "argmax_agreement": agree / total, "ppl_reference": ppl_ref,
            "ppl_tier": ppl_tier, "ppl_change": ppl_tier / ppl_ref - 1.0}
