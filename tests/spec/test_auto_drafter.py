"""The ``auto`` draft source: prompt lookup and the shared suffix index both propose, the draft
with the higher calibrated expected accepted length is used, each source calibrated apart."""

from deepinfer.spec.auto_drafter import AutoDrafter
from deepinfer.spec.calibration import Calibrator
from deepinfer.spec.drafters import NgramDrafter, SuffixDrafter


def auto(window=100):
    cal = Calibrator(window)
    return AutoDrafter([NgramDrafter(1, 3), SuffixDrafter(1, 3)], cal), cal


def test_takes_the_only_source_with_a_draft():
    d, _ = auto()
    own = [1, 2, 3, 10, 11, 12, 1, 2, 3]  # "1 2 3" occurred earlier in the sequence itself
    draft = d.propose(own, 3)
    assert (draft.source, draft.tokens, draft.features) == ("ngram", [10, 11, 12], [3, 3, 3])
    assert d.propose([40, 41, 42], 3).tokens == []  # nothing anywhere: an empty draft
    d.observe([7, 40, 41, 42, 50, 51])  # another request continued "40 41 42" with 50 51
    draft = d.propose([40, 41, 42], 3)
    assert (draft.source, draft.tokens) == ("suffix", [50, 51])


def test_picks_the_longer_draft_while_uncalibrated_and_ngram_on_ties():
    d, _ = auto()
    d.observe([9, 5, 6, 20, 21, 22, 23])
    seq = [5, 6, 30, 5, 6]  # own history: "5 6" -> 30 then 5 6 (the end); index: 20 21 22 23
    assert d.propose(seq, 4).source == "suffix"  # 4 tokens beat ngram's 3 under the same prior
    both = [5, 6, 20, 21, 22, 23, 5, 6]  # now both propose 20 21 22 23, same features' prior
    assert d.propose(both, 4).source == "ngram"


def test_calibration_moves_the_choice_to_the_source_that_gets_accepted():
    d, cal = auto()
    d.observe([9, 5, 6, 20, 21, 22])
    seq = [5, 6, 30, 31, 32, 5, 6]  # ngram: 30 31 32 (match length 2); suffix: 20 21 22
    first = d.propose(seq, 3)
    assert first.source == "ngram"  # tie under the prior
    for _ in range(5):  # prompt lookup keeps being rejected at once, the index fully accepted
        cal.update("ngram", first.features, 0)
        cal.update("suffix", d.sources[1].propose(seq, 3).features, 3)
    draft = d.propose(seq, 3)
    assert (draft.source, draft.tokens) == ("suffix", [20, 21, 22])
    assert sum(cal.survival("suffix", draft.features)) > sum(cal.survival("ngram", first.features))
    assert set(cal.recent) == {"ngram", "suffix"}  # each source has its own ECE window
    assert cal.ece("ngram") > 0.5 > cal.ece("suffix")
