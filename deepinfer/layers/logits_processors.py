"""Penalties and logit bias on a batch of logits, for the rows that ask for them (vLLM semantics).

Order, as vLLM: logit bias, then the repetition penalty (over prompt and output tokens: a
seen token's positive logit is divided by it, a negative one multiplied), then the frequency
penalty (times the token's count in the output) and the presence penalty (once for any token
in the output) are subtracted. Temperature and the top-k/top-p/min-p filters come after, in
the sampler. Token counts are rebuilt from the token lists each step (no state to keep right
across preemption or forks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling_params import SamplingParams


def apply_logit_bias(logits: torch.Tensor, rows: list[int],
                     params: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` ({token id: bias}) in place."""
    dev = logits.device
    for row, p in zip(rows, params):
        ids = torch.tensor(list(p.logit_bias), device=dev, dtype=torch.long)
        bias = torch.tensor(list(p.logit_bias.values()), device=dev, dtype=logits.dtype)
        logits[row].index_add_(0, ids, bias)


def apply_penalties(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                    prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> None:
    """Repetition, frequency and presence penalties in place for ``rows``."""
    dev, V = logits.device, logits.shape[1]
    idx = torch.tensor(rows, device=dev)
    x = logits[idx]
    counts = _counts(output_ids, V, dev)
    in_prompt = _counts(prompt_ids, V, dev) > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    seen = in_prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    x = x - freq * counts - pres * (counts > 0)
    logits[idx] = x.to(logits.dtype)


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id per list (one bincount)."""
    ids = torch.cat([torch.tensor(list(toks), dtype=torch.long) + j * vocab
                     for j, toks in enumerate(token_lists)]).to(dev)
    n = len(token_lists) * vocab
    return torch.bincount(ids, minlength=n).view(len(token_lists), vocab).float()
