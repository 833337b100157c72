"""Online calibration: binned acceptance rates under a prior, conditional updates, ECE."""

import random

import pytest

from deepinfer.spec.calibration import Calibrator


def test_unseen_bins_start_at_the_prior_and_learn_rates():
    c = Calibrator(window=100, prior_accept=1.0, prior_reject=1.0)
    assert c.confidence("ngram", 0, 3) == 0.5
    for _ in range(98):
        c.update("ngram", [3], 1)  # position 0 accepted
    for _ in range(98):
        c.update("ngram", [2], 0)  # feature 2: rejected
    # each bin's prior mean is the other feature's rate (1/100 and 99/100), weight 2
    assert c.confidence("ngram", 0, 3) == pytest.approx((98 + 2 * 1 / 100) / 100)
    assert c.confidence("ngram", 0, 2) == pytest.approx((0 + 2 * 99 / 100) / 100)
    assert c.confidence("suffix", 0, 3) == 0.5  # sources are kept apart
    assert Calibrator(window=1).confidence("ngram", 0, 0) == pytest.approx(0.9)  # optimistic default


def test_update_counts_positions_up_to_the_first_rejection():
    c = Calibrator(window=100, prior_accept=1.0, prior_reject=1.0)
    c.update("ngram", [4, 4, 4, 4], 1)  # position 0 accepted, 1 rejected, 2-3 never tried
    assert c.counts == {("ngram", 0, 4): [1, 1], ("ngram", 1, 4): [0, 1]}
    c.update("ngram", [4, 4], 2)  # all verified accepted: nothing rejected
    assert c.counts[("ngram", 1, 4)] == [1, 2]
    assert ("ngram", 2, 4) not in c.counts
    assert c.survival("ngram", [4, 4]) == pytest.approx([3 / 4, 3 / 4 * 2 / 4])
    assert c.pooled == {("ngram", 0): [2, 2], ("ngram", 1): [1, 2]}


def test_an_unseen_feature_starts_at_its_positions_rate_not_the_prior():
    c = Calibrator(window=100)  # the optimistic default prior, mean 0.9, weight 2
    for f in range(8):  # plain chat: every draft rejected at once, each with its own feature
        c.update("ngram", [f, f], 0)
    assert c.confidence("ngram", 0, 99) == pytest.approx(1.8 / 10)  # not 0.9 for a new value
    # a seen feature: its own rejection under the rate of the 7 others, (0 + 2 * 1.8/9) / (1 + 2)
    assert c.confidence("ngram", 0, 0) == pytest.approx(2 * 1.8 / 9 / 3)
    assert c.confidence("ngram", 1, 99) == pytest.approx(0.9)  # position 1 was never tried
    assert c.confidence("suffix", 0, 99) == pytest.approx(0.9)


def test_ece_is_small_when_calibrated_and_large_when_not():
    rng = random.Random(0)
    c = Calibrator(window=5000)
    for _ in range(5000):  # true rate 0.8 in bin 1, 0.2 in bin 2
        f = rng.choice([1, 2])
        c.update("ngram", [f], int(rng.random() < (0.8 if f == 1 else 0.2)))
    assert c.ece("ngram") < 0.05
    biased = Calibrator(window=100, prior_accept=1000.0, prior_reject=1.0)  # claims ~1.0
    for _ in range(100):
        biased.update("ngram", [0], 0)
    assert biased.ece("ngram") > 0.8
    assert biased.ece("suffix") == 0.0  # each source has its own window
    biased.update("suffix", [0], 1)
    assert biased.ece("suffix") < 0.01 and biased.ece("ngram") > 0.8
    assert Calibrator(window=10).ece("ngram") == 0.0
