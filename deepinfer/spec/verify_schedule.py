"""How many draft tokens of each request to verify in a step: DSpark's Algorithm 1
(hardware-aware prefix scheduler) over an SPS(B) profile.

SPS(B) is verify steps per second when the batch holds B tokens; the expected accepted tokens
per step are tau = R + sum of a_{r,j} over the verified pairs (every request emits at least
one token), so throughput is Theta = tau * SPS(B). Pairs are taken in descending a_{r,j}
while each raises Theta (DSpark's walk, exactly).
"""

from __future__ import annotations

import itertools
import math
import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Callable


class SpsProfile:
    """SPS(B) from measured points: step time is interpolated linearly between them and
    extrapolated from the last two beyond the largest. Times are made non-decreasing in B (a
    running maximum), since more tokens never cost less: a noisy point cannot invert the curve.

    Only the curve's shape decides the walk (scaling SPS by a constant changes no comparison),
    so the profile keeps log step times relative to the 1-token point. The start-up shape
    (each size against a 1-token step of the same round) is refined by the steps the engine
    then runs (``observe``), and on a shared machine the load moves between them: absolute
    times taken whenever a plan picks a size, compared across sizes, priced sizes observed
    under a burst above sizes observed after it, and a 1-token point that no step re-observes
    while every step verifies kept an older load's time. So consecutive observed steps form
    windows of ``WINDOW`` steps that share one load level, and log time = level(window) +
    shape(size) is fitted by alternating medians over the last ``HISTORY`` steps: a load shift
    moves the levels, not the shape. A size with ``MIN_OBSERVED`` steps takes its fitted shape
    (fewer, on a noisy machine, over-priced a size now and then, and with it every larger one,
    which then no step ran to correct until the history forgot them);
    the fit fixes shapes only relative to each other, so they are anchored at the 1-token point
    when steps ran it, else so that their median correction over the start-up shape is 0 (the
    start-up ratio to a decode is then the only one known). Sizes no step ran take the
    start-up shape plus the correction interpolated between their observed neighbours.

    Every span point is also priced at no more than an observed point with more tokens: the
    scheduler never picks a size it over-prices, so without that bound no step would ever
    correct it, while an under-priced size is picked, observed and corrected."""

    WINDOW = 8  # consecutive observed steps taken to share one load level
    HISTORY = 64  # observed steps kept (8 windows)
    MIN_OBSERVED = 8  # a size's steps in the history before its fit counts
    PASSES = 30  # the most alternating-median passes per completed window (warm-started)
    TOLERANCE = 1e-3  # ... stopping once no log shape moves more than this

    def __init__(self, tokens: list[int], steps_per_s: list[float]) -> None:
        if not tokens or len(tokens) != len(steps_per_s) or sorted(tokens) != list(tokens):
            raise ValueError("SPS profile needs ascending token counts, one rate each")
        if any(s <= 0 for s in steps_per_s):
            raise ValueError("SPS rates must be positive")
        self.tokens = list(tokens)
        self.index = {b: i for i, b in enumerate(tokens)}
        self.start = [math.log(steps_per_s[0] / s) for s in steps_per_s]  # log t(b) / t(1)
        self.shape = list(self.start)
        self.history: deque[tuple[int, int, float]] = deque(maxlen=self.HISTORY)
        self.observed = 0  # steps observed so far (their windows are observed // WINDOW)
        self.level = 1.0 / steps_per_s[0]  # the latest window's 1-token time (SPS's scale)
        self.seen: set[int] = set()  # points with MIN_OBSERVED steps in the history
        self._price()

    def observe(self, b: int, seconds: float) -> None:
        """A step of ``b`` tokens took ``seconds`` (ignored unless ``b`` is a profiled point);
        the fit runs when a window is complete."""
        i = self.index.get(b)
        if i is None:
            return
        self.history.append((self.observed // self.WINDOW, i, math.log(seconds)))
        self.observed += 1
        if self.observed % self.WINDOW == 0:
            self._fit()
            self._price()

    def _fit(self) -> None:
        """Alternating medians of log time = level(window) + shape(size), warm-started at the
        last fit's shape."""
        seen: dict[int, float] = {}
        for _ in range(self.PASSES):
            by_window: dict[int, list[float]] = {}
            for w, i, y in self.history:
                by_window.setdefault(w, []).append(y - self.shape[i])
            level = {w: statistics.median(v) for w, v in by_window.items()}
            by_size: dict[int, list[float]] = {}
            for w, i, y in self.history:
                by_size.setdefault(i, []).append(y - level[w])
            seen = {i: statistics.median(v) for i, v in by_size.items() if len(v) >= self.MIN_OBSERVED}
            shape, self.shape = self.shape, self._anchored(seen)
            if max(abs(x - y) for x, y in zip(shape, self.shape)) < self.TOLERANCE:
                break
        self.level = math.exp(level[max(level)])  # the anchored shape of 1 token is 0
        self.seen = set(seen)

    def _anchored(self, seen: dict[int, float]) -> list[float]:
        """The full shape from the fitted ``seen`` sizes (see the class docstring)."""
        if not seen:
            return list(self.start)
        shift = -seen[0] if 0 in seen else statistics.median(self.start[i] - s for i, s in seen.items())
        known = sorted(seen.items())
        xs = [self.tokens[i] for i, _ in known]
        corr = [s + shift - self.start[i] for i, s in known]
        if 0 not in seen:  # the anchor: the 1-token point keeps its start-up shape (0)
            xs, corr = [self.tokens[0]] + xs, [0.0] + corr
        return [s + interpolate(xs, corr, b) for b, s in zip(self.tokens, self.start)]

    def _price(self) -> None:
        points = [self.level * math.exp(s) for s in self.shape]
        cap = float("inf")  # the cheapest observed step with more tokens
        for i in reversed(range(1, len(points))):
            points[i] = min(points[i], cap)
            if i in self.seen:
                cap = points[i]
        self.seconds = list(itertools.accumulate(points, max))

    def __call__(self, b: int) -> float:
        t, s = self.tokens, self.seconds
        if len(t) == 1 or b <= t[0]:
            return 1.0 / s[0]
        i = min(max(bisect_left(t, b), 1), len(t) - 1)
        sec = s[i - 1] + (s[i] - s[i - 1]) * (b - t[i - 1]) / (t[i] - t[i - 1])
        return 1.0 / sec


def interpolate(xs: list[int], ys: list[float], x: int) -> float:
    """ys at x, linear between the points ``xs`` (ascending), constant beyond them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def plan_verify(survival: list[list[float]], sps: Callable[[int], float],
                base_tokens: int = 0) -> list[int]:
    """Algorithm 1: per request, how many leading draft tokens to verify.

    ``survival[r][j]`` is a_{r,j+1}; ``base_tokens`` counts the step's other tokens (prefill
    chunks), which the verify step's cost includes. Start at B = R, tau = R, best = R * SPS(B);
    take the pairs in descending a; for each, B += 1, tau += a, Theta = tau * SPS(B); keep it if
    Theta > best, else stop at once. So every verified token raised Theta when it was added (no
    verified token has a negative marginal value), and where step time is convex in B (affine on
    a CPU, flat then affine on a GPU) Theta is unimodal along the walk, so the stop is the
    optimum. Walking on past a dip would trust the scheduler's least certain estimates (deep
    draft positions, priced by the calibration's optimistic prior) to pay for the tokens
    before them."""
    R = len(survival)
    counts = [0] * R
    if R == 0:
        return counts
    b, tau = R, float(R)
    best = tau * sps(base_tokens + b)
    pairs = sorted(((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
                   key=lambda p: (-p[0], p[1], p[2]))
    # a_{r,j} never grows with j (a product of confidences <= 1) and ties go earlier first,
    # so each request's verified tokens stay a prefix of its draft
    for a, r, _ in pairs:
        b, tau = b + 1, tau + a
        theta = tau * sps(base_tokens + b)
        if theta <= best:
            break
        best = theta
        counts[r] += 1
    return counts
