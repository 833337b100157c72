"""Verification: greedy keeps the argmax path; rejection sampling keeps the target distribution."""

import pytest
import torch

from deepinfer.layers.sampler import filtered_probs
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.verify import verify

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_accepts_the_matching_prefix_plus_the_argmax():
    logits = torch.full((4, 6), -1.0)
    for i, t in enumerate([2, 3, 5, 1]):
        logits[i, t] = 1.0
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [2, 3, 5], greedy, None) == [2, 3, 5, 1]  # all accepted + bonus
    assert verify(logits, [2, 4, 5], greedy, None) == [2, 3]  # stops at the first mismatch
    assert verify(logits[:1], [], greedy, None) == [2]


CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


def chi2(observed, probs):
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    target = filtered_probs(logits, [params, params])
    draft = int(target[0].argmax())  # a likely draft token, so both branches are exercised
    n = 4000
    first = torch.zeros(6)
    second_after_accept = torch.zeros(6)
    for _ in range(n):
        out = verify(logits, [draft], params, g)
        first[out[0]] += 1
        if len(out) == 2:
            second_after_accept[out[1]] += 1
    assert first[target[0] == 0].sum() == 0  # top-k filtered tokens are never emitted
    for observed, probs in ((first, target[0]), (second_after_accept, target[1])):
        keep = probs > 0
        assert int(keep.sum()) == 5  # top-k 5: 4 degrees of freedom
        assert chi2(observed[keep], probs[keep]) < CHI2_DF4_P001
