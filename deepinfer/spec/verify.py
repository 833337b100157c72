"""Exact verification of a draft against the target model's logits at every span position.

Row i of ``logits`` predicts the token after the span's i-th token (the request's last token,
then the draft). Greedy accepts the draft while it equals the argmax, then emits the argmax
(the bonus token): the same tokens plain greedy decoding produces. With temperature > 0 a
draft token x drawn from q is kept with probability min(1, p(x) / q(x)), and on a rejection
the replacement is drawn from the normalised residual max(p - q, 0): every emitted token is
distributed exactly as the target's. A weight-free draft is a point mass (q = 1 on its
token): x is kept with probability p(x), the residual is p with x removed.
"""

from __future__ import annotations

import torch

from ..layers.native_ops import argmax_rows
from ..layers.sampler import filtered_probs
from ..sampling_params import SamplingParams


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    target = argmax_rows(logits).tolist()
    out: list[int] = []
    for d, t in zip(draft, target):
        if d != t:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def verify_sampled(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                   generator: torch.Generator | None, q: torch.Tensor | None = None) -> list[int]:
    """``q``: the draft distributions (one row per draft token); None: point masses."""
    probs = filtered_probs(logits.float(), [params] * logits.shape[0])
    out: list[int] = []
    for i, d in enumerate(draft):
        u = torch.rand((), device=probs.device, generator=generator)
        qd = 1.0 if q is None else q[i, d]
        if u * qd < probs[i, d]:
            out.append(d)
            continue
        if q is None:  # max(p - q, 0) for a point mass on d: p without d
            residual = probs[i].clone()
            residual[d] = 0.0
        else:
            residual = (probs[i] - q[i].to(probs.dtype)).clamp_min(0.0)
        total = residual.sum()
        # p <= q everywhere means x was always kept: only rounding gets here
        residual = residual / total if total > 0 else probs[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)[0]))
    return out


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None, q: torch.Tensor | None = None) -> list[int]:
    """Tokens to emit: the accepted draft prefix plus one token from the target."""
    if params.greedy:
        return verify_greedy(logits, draft)
    return verify_sampled(logits, draft, params, generator, q)
