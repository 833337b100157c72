"""Algorithm 1 against a brute-force optimum over every prefix choice, on small cases."""

import itertools
import random

import pytest

from deepinfer.spec.verify_schedule import SpsProfile, plan_verify


def throughput(survival, counts, sps, base=0):
    tau = len(survival) + sum(sum(row[:c]) for row, c in zip(survival, counts))
    return tau * sps(base + len(survival) + sum(counts))


def brute_force(survival, sps, base=0):
    choices = itertools.product(*[range(len(row) + 1) for row in survival])
    return max(throughput(survival, c, sps, base) for c in choices)


def random_survival(rng, r, k):
    rows = []
    for _ in range(r):
        a, row = 1.0, []
        for _ in range(rng.randint(0, k)):
            a *= rng.uniform(0.05, 1.0)
            row.append(a)
        rows.append(row)
    return rows


PROFILES = {
    # step time affine in tokens (CPU-like)
    "affine": lambda b: 1.0 / (0.02 + 0.004 * b),
    # flat until the device saturates, then affine (GPU-like)
    "knee": lambda b: 1.0 / max(0.02, 0.012 + 0.001 * b),
    "table": SpsProfile([1, 2, 4, 8, 16, 32], [50.0, 49.0, 48.0, 45.0, 30.0, 16.0]),
    # CPU-like: the first span token switches from the decode path (a jump), later ones are cheap
    "jump": SpsProfile([1, 2, 3, 5, 9], [10.0, 6.0, 5.8, 5.5, 5.0]),
}


@pytest.mark.parametrize("name", ["affine", "knee", "table"])
def test_matches_brute_force_optimum(name):
    """Where step time is convex in B, Theta is unimodal along the walk: its stop is optimal."""
    sps, rng = PROFILES[name], random.Random(0)
    for _ in range(300):
        survival = random_survival(rng, rng.randint(1, 4), 4)
        base = rng.choice([0, 0, 7])
        counts = plan_verify(survival, sps, base)
        assert all(0 <= c <= len(row) for c, row in zip(counts, survival))
        assert throughput(survival, counts, sps, base) == pytest.approx(brute_force(survival, sps, base))


@pytest.mark.parametrize("name", ["table", "jump"])
def test_never_verifies_a_token_with_negative_marginal_value(name):
    sps, rng = PROFILES[name], random.Random(1)
    for _ in range(300):
        survival = random_survival(rng, rng.randint(1, 5), 5)
        counts = plan_verify(survival, sps)
        for r, c in enumerate(counts):
            if c == 0:
                continue
            fewer = list(counts)
            fewer[r] -= 1  # dropping the request's last verified token must not help
            assert throughput(survival, fewer, sps) < throughput(survival, counts, sps)


def test_cheap_verification_takes_everything_and_costly_none():
    survival = [[0.9, 0.8], [0.5]]
    assert plan_verify(survival, lambda b: 100.0) == [2, 1]  # free tokens: verify all
    assert plan_verify(survival, lambda b: 1.0 / b) == [0, 0]  # a token costs a full step
    assert plan_verify([], lambda b: 1.0) == []


def test_below_the_profiles_break_even_verifies_nothing_beyond_the_base_token():
    sps = PROFILES["jump"]  # one span token costs 1/6 - 1/10 s: worth it above a = 2/3
    one = [[0.6, 0.06, 0.05, 0.04]]  # every prefix's tau stays below what its step time needs
    assert all(sum(one[0][:n]) + 1 < sps(1) / sps(n + 1) for n in range(1, 5))
    assert plan_verify(one, sps) == [0]
    # above break-even only as a run: the first token alone loses, all four together would
    # win, but Algorithm 1 stops at once at the first pair that does not raise Theta
    run = [[0.65, 0.65, 0.65, 0.65]]
    assert 1.65 < sps(1) / sps(2) and 1 + 4 * 0.65 > sps(1) / sps(5)
    assert plan_verify(run, sps) == [0]
    assert plan_verify([[0.7, 0.65, 0.65, 0.65]], sps) == [4]  # the first pays: the walk goes on


def test_walk_stops_at_the_first_pair_that_does_not_raise_theta():
    """Each verified pair raised Theta over the pairs before it, the next one would not."""
    rng = random.Random(2)
    for name, sps in PROFILES.items():
        for _ in range(200):
            survival = random_survival(rng, rng.randint(1, 4), 4)
            counts = plan_verify(survival, sps)
            pairs = sorted(((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
                           key=lambda p: (-p[0], p[1], p[2]))
            n = sum(counts)
            taken = [0] * len(survival)
            thetas = []
            for _, r, _ in pairs[: n + 1]:
                thetas.append(throughput(survival, taken, sps))
                taken[r] += 1
            thetas.append(throughput(survival, taken, sps))
            assert all(x < y for x, y in zip(thetas[:n], thetas[1 : n + 1])), name
            assert n == len(pairs) or thetas[n + 1] <= thetas[n], name


def test_profile_interpolates_step_time():
    p = SpsProfile([1, 4], [100.0, 50.0])  # 10 ms, 20 ms
    assert p(1) == pytest.approx(100.0)
    assert p(2) == pytest.approx(1 / (0.010 + 0.010 / 3))
    assert p(7) == pytest.approx(1 / 0.030)  # extrapolated
    noisy = SpsProfile([1, 2, 4], [100.0, 50.0, 80.0])  # 4 tokens measured faster than 2
    assert noisy(4) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        SpsProfile([4, 1], [1.0, 1.0])


def observe_windows(p, steps):
    """Feed (tokens, seconds) steps; the list fills whole windows."""
    assert len(steps) % SpsProfile.WINDOW == 0
    for b, t in steps:
        p.observe(b, t)


def test_profile_follows_the_step_times_it_observes():
    p = SpsProfile([1, 2, 5], [100.0, 50.0, 40.0])  # start-up: 10, 20, 25 ms
    W = SpsProfile.WINDOW
    assert SpsProfile.MIN_OBSERVED <= W
    for _ in range(W - 1):
        p.observe(2, 0.012)
    assert p(2) == pytest.approx(50.0)  # no complete window yet: still as measured
    p.observe(3, 1.0)  # not a profiled point: ignored
    p.observe(2, 0.012)
    # only 2-token steps: nothing to compare them with, so the single observed size keeps its
    # start-up ratio to the 1-token point (the anchor), at the window's load
    assert p.seen == {1} and p(2) * p.seconds[0] == pytest.approx(0.5)
    assert p(2) == pytest.approx(1 / 0.012, rel=1e-3)
    observe_windows(p, [(1, 0.010), (2, 0.012)] * W)  # 2-token steps beside 1-token ones
    assert p.seen == {0, 1} and 1 / (p(2) * p.seconds[0]) == pytest.approx(1.2, rel=1e-3)
    assert 1 / (p(5) * p.seconds[0]) == pytest.approx(1.2 * 1.25, rel=1e-3)  # unobserved: moves with 2
    assert 1 / (p(3) * p.seconds[0]) == pytest.approx(1.2 * (1 + 0.25 / 3), rel=1e-3)
    assert p.seconds[0] == pytest.approx(0.010, rel=1e-3)  # the scale: the latest window's 1-token time
    for _ in range(SpsProfile.HISTORY // W):  # the old steps leave the history
        observe_windows(p, [(1, 0.010), (2, 0.015)] * (W // 2))
    assert 1 / (p(2) * p.seconds[0]) == pytest.approx(1.5, rel=1e-3)


def test_a_load_shift_between_windows_leaves_the_walks_decisions_unchanged():
    """Steps of 5 and 9 tokens, the 1-token point never observed, the load switching between
    windows (a 2-3x slower machine): the fitted shape is the same as under a steady load."""
    rng = random.Random(3)
    W = SpsProfile.WINDOW
    start = [100.0, 80.0, 70.0, 60.0, 45.0]  # 1, 2, 3, 5, 9 tokens
    steady, shifted = SpsProfile([1, 2, 3, 5, 9], start), SpsProfile([1, 2, 3, 5, 9], start)
    for _ in range(6):
        load = rng.choice([1.0, 2.0, 3.0])
        for _ in range(W):
            b = rng.choice([5, 9])
            t = 0.010 * (1 + 0.04 * b) * (1 + 0.02 * rng.random())
            steady.observe(b, t)
            shifted.observe(b, t * load)
    for p in (steady, shifted):
        assert p.seen == {3, 4}
        # the 9-token step's ratio to the 5-token one is what was observed, not the start-up's
        assert p(5) / p(9) == pytest.approx(1.36 / 1.2, rel=0.02)
    ratios = lambda p: [p(b) / p(1) for b in range(1, 10)]
    assert ratios(shifted) == pytest.approx(ratios(steady))
    for _ in range(200):
        survival = random_survival(rng, rng.randint(1, 3), 8)
        assert plan_verify(survival, shifted) == plan_verify(survival, steady)


def test_a_burst_within_one_window_does_not_move_the_shape():
    """Observed sizes are compared within windows: a window whose steps all ran slow only
    moves that window's level."""
    W = SpsProfile.WINDOW
    p = SpsProfile([1, 2, 5], [100.0, 80.0, 60.0])
    observe_windows(p, [(1, 0.010), (2, 0.011)] * (W // 2) * 2)
    before = [p(b) / p(1) for b in (2, 5)]
    observe_windows(p, [(1, 0.030), (2, 0.033)] * (W // 2))  # everything 3x slower
    assert [p(b) / p(1) for b in (2, 5)] == pytest.approx(before)
    assert p.seconds[0] == pytest.approx(0.030)


def test_an_observed_larger_step_bounds_the_sizes_no_step_has_run():
    p = SpsProfile([1, 2, 5, 9], [100.0, 40.0, 38.0, 35.0])  # start-up: 10, 25, 26.3, 28.6 ms
    W = SpsProfile.WINDOW
    # 1- and 9-token steps side by side, 9 at 1.5x: 2 and 5 were over-priced
    observe_windows(p, [(1, 0.010), (9, 0.015)] * W)
    assert p.seen == {0, 3}
    assert p(9) == pytest.approx(1 / 0.015)
    assert p(2) == pytest.approx(1 / 0.015) and p(5) == pytest.approx(1 / 0.015)
    assert p(1) == pytest.approx(100.0)
    observe_windows(p, [(2, 0.012), (9, 0.015)] * W)  # then the 2-token steps run
    assert p.seen == {0, 1, 3}
    assert p(2) == pytest.approx(1 / 0.012, rel=1e-3)
    # between two observed sizes: the start-up shape, corrected as its neighbours were
    assert 1 / 0.015 < p(5) < 1 / 0.012
