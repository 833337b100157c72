"""Token sampling for a batch of sequences with per-request parameters.

Greedy rows take the argmax of the raw logits. Other rows apply temperature, then top-k,
top-p and min-p on one sorted copy, and draw with the request's own generator when it has a
seed, so a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams
from .native_ops import argmax_rows


@dataclass
class SampleResult:
    tokens: list[int]
    # log-prob of each sampled token (None if nobody asked; an entry is None only in a
    # ``concat`` of rows sampled apart, for a row that did not ask)
    logprobs: list[float | None] | None
    top_logprobs: list[list[tuple[int, float]]] | None

    @staticmethod
    def concat(parts: list[SampleResult]) -> SampleResult | None:
        """One result for rows sampled apart."""
        if not parts:
            return None
        tokens = [t for p in parts for t in p.tokens]
        if all(p.logprobs is None for p in parts):
            return SampleResult(tokens, None, None)
        lps = [lp for p in parts for lp in (p.logprobs or [None] * len(p.tokens))]
        tops = [t for p in parts for t in (p.top_logprobs or [[]] * len(p.tokens))]
        return SampleResult(tokens, lps, tops)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampleResult:
    """``logits`` in the model's dtype or float32; widened to float32 only for the rows that
    sample and for log-probs (a greedy bf16 row's argmax is the same on its bf16 values)."""
    tokens = argmax_rows(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits[rows].float(), [params[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    token_list = tokens.tolist()
    if all(p.logprobs is None and p.num_samples == p.n for p in params):  # best_of ranks by logprob
        return SampleResult(token_list, None, None)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    top: list[list[tuple[int, float]]] = []
    for i, p in enumerate(params):
        k = p.logprobs or 0
        if k:
            vals, ids = logp[i].topk(k)
            top.append(list(zip(ids.tolist(), vals.tolist())))
        else:
            top.append([])
    return SampleResult(token_list, chosen, top)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    logits = logits / temp
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    V = logits.shape[-1]
    rank = torch.arange(V, device=dev)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    keep = rank < top_k
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep &= (probs.cumsum(dim=-1) - probs) < top_p
    keep &= probs >= min_p * probs[:, :1]
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)
