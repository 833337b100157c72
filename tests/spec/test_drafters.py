"""Draft sources: prompt lookup and the suffix index shared across requests."""

from deepinfer.spec.drafters import NgramDrafter, SuffixDrafter


def test_ngram_takes_the_longest_suffix_match():
    d = NgramDrafter(1, 3)
    #              a  b  c  X  ...  b  c  Y  ...  a  b  c
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
    draft = d.propose(tokens, 2)
    assert draft.tokens == [10, 11]  # "1 2 3" (length 3) beats the later "2 3" (length 2)
    assert draft.features == [3, 3]
    assert draft.source == "ngram"


def test_ngram_prefers_the_latest_of_equal_matches_and_respects_min():
    d = NgramDrafter(1, 2)
    assert d.propose([5, 6, 5, 7, 5], 1).tokens == [7]
    assert NgramDrafter(2, 3).propose([5, 6, 4, 5], 3).tokens == []  # only a 1-token match
    assert d.propose([5, 6, 7], 3).tokens == []  # the last token never occurred before
    assert d.propose([1, 2, 1, 2, 1], 5).tokens == [2, 1]  # continuation stops at the end


def test_ngram_feature_is_how_far_the_match_extends_past_max_n():
    d = NgramDrafter(1, 3)
    copied = list(range(100, 140))  # a 40-token stretch of the prompt, copied in the reply
    assert d.propose([7] + copied[:20] + [55] + copied[:20], 2).features == [7, 7]  # 20: 16-31
    assert d.propose([7] + copied[:6] + [55] + copied[:6], 2).features == [5, 5]  # 6: 5-7
    whole = d.propose(copied + [55] + copied, 2)  # a 40-token match: 32 and beyond are one bucket
    assert (whole.tokens, whole.features) == ([55, 100], [8, 8])
    # the draft is still the latest match of length max_n: the longer one further back loses
    two = [1, 2, 3, 4, 9, 8, 3, 4, 5, 2, 3, 4]
    assert d.propose(two, 1).tokens == [9] and d.propose(two, 1).features == [3]
    assert d.propose([1, 2, 3, 4, 9, 5, 2, 3, 4, 6, 2, 3, 4], 1).tokens == [6]


def test_suffix_index_proposes_what_other_requests_continued():
    d = SuffixDrafter(1, 3)
    assert d.propose([7, 8, 9], 4).tokens == []  # empty index
    d.observe([1, 7, 8, 9, 4, 5, 6])
    d.observe([2, 7, 8, 9, 4, 5, 6])
    d.observe([3, 8, 9, 30])
    draft = d.propose([100, 7, 8, 9], 3)
    assert draft.tokens == [4, 5, 6]  # "7 8 9" -> 4 twice, while "8 9" alone also saw 30
    # the first step: context "7 8 9" (length 3), continuation share 2/2 -> 4 + 5 * 2
    assert draft.features[0] == 14
    assert d.propose([100, 8, 9], 1).tokens == [4]  # "8 9": 4 (twice) beats 30 (once)
    assert d.propose([100, 8, 9], 1).features == [round(4 * 2 / 3) + 5]


def test_suffix_index_is_bounded():
    d = SuffixDrafter(1, 2, max_contexts=10)
    d.observe(list(range(100)))
    assert len(d.next) == 10
    assert d.propose([98], 1).tokens == [99]  # the most recent contexts stay


def test_suffix_index_learns_only_past_the_cached_prefix():
    """A finished request's cached prefix was learnt when it was computed: only the
    continuations from ``start`` on are counted (contexts may reach back into the prefix)."""
    d = SuffixDrafter(1, 2)
    d.observe([1, 2, 3, 4], start=2)
    assert d.propose([1], 1).tokens == []  # "1 -> 2" lies inside the prefix: not counted
    assert d.propose([2], 1).tokens == [3] and d.propose([9, 1, 2], 2).tokens == [3, 4]
    assert set(d.next) == {(2,), (1, 2), (3,), (2, 3)}
