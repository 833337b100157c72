"""Random walks over the tokens a grammar allows: the property tests of the reply grammars
(DSML, answer-or-calls) check every output such a walk can produce."""

from __future__ import annotations

import random

import torch

from deepinfer.structured.grammar import GrammarState


def random_walk(state: GrammarState, vocab_size: int, eos: int, rng: random.Random,
                markers: list[int] = (), start: list[int] = (), limit: int = 4000) -> list[int]:
    """``start``, then tokens drawn uniformly from what the grammar allows (EOS as soon as it
    is; an allowed marker token 60% of the time, so walks end), until the grammar completes."""
    out = list(start)
    assert all(state.accept(t) for t in out)
    bitmask = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)
    while not state.terminated:
        assert len(out) < limit
        bitmask.zero_()
        state.fill(bitmask, 0)
        bits = ((bitmask[0, :, None] >> torch.arange(32)) & 1).flatten()[:vocab_size]
        allowed = bits.nonzero().flatten().tolist()
        favoured = [t for t in markers if t in allowed]
        t = eos if eos in allowed else favoured[0] if favoured and rng.random() < 0.6 \
            else rng.choice(allowed)
        assert state.accept(t)
        out.append(t)
    return out
