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
    assert c.confidence("ngram", 0, 3) == pytest.approx(99 / 100)
    assert c.confidence("ngram", 0, 2) == pytest.approx(1 / 100)
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
