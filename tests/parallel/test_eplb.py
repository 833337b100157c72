"""EPLB expert placement: replicas to the heaviest experts, balanced packing, imbalance figures."""

import pytest

from deepinfer.parallel.eplb import balanced_placement, contiguous_placement, placement_report


def test_contiguous_is_static_layout():
    p = contiguous_placement(8, 2)
    assert p.devices == ((0, 1, 2, 3), (4, 5, 6, 7)) and p.copies == (1,) * 8
    assert p.imbalance([8, 1, 1, 1, 1, 1, 1, 2]) == pytest.approx(11 / 8)
    with pytest.raises(ValueError, match="split evenly"):
        contiguous_placement(6, 4)


def test_hot_expert_gets_the_replicas_and_packing_balances():
    loads = [8, 1, 1, 1, 1, 1, 1, 2]
    p = balanced_placement(loads, 2, extra=1)
    # two extra slots: both to expert 0 (8 -> 4 -> 8/3 per copy beats expert 7's 2)
    assert p.copies == (3, 1, 1, 1, 1, 1, 1, 1)
    assert sorted(len(s) for s in p.devices) == [5, 5]
    assert sorted(e for s in p.devices for e in s) == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert sum(p.device_loads(loads)) == pytest.approx(16)
    # three copies on two devices: two share one; the best split is 8/3 * 2 + 3 against 8/3 + 2 + 3
    assert p.imbalance(loads) == pytest.approx((8 / 3 * 2 + 3) / 8)
    assert p.imbalance(loads) < contiguous_placement(8, 2).imbalance(loads)


def test_replica_of_spreads_tokens_over_copies():
    p = balanced_placement([8, 1, 1, 1, 1, 1, 1, 2], 2, extra=1)
    served = [p.replica_of(0, t) for t in range(6)]
    assert set(served) == {0, 1}
    for e in range(1, 8):
        (d,) = {p.replica_of(e, t) for t in range(4)}
        assert e in p.devices[d]


def test_uniform_loads_stay_balanced_and_report_per_layer():
    stats = {"layers": {3: {"total": [5] * 16}, 1: {"total": [40] + [1] * 15}}}
    rep = placement_report(stats, 4, extra=1)
    assert [r.layer for r in rep] == [1, 3]
    assert rep[1].before == pytest.approx(1.0) and rep[1].after == pytest.approx(1.0)
    assert rep[0].before == pytest.approx(43 / (55 / 4))
    assert rep[0].after < rep[0].before
