"""How many draft tokens of each request to verify in a step: DSpark's Algorithm 1
(hardware-aware prefix scheduler) over an SPS(B) profile.

SPS(B) is verify steps per second when the batch holds B tokens; the expected accepted tokens
per step are tau = R + sum of a_{r,j} over the verified pairs (every request emits at least
one token), so throughput is Theta = tau * SPS(B). Pairs are taken in descending a_{r,j}
while each raises Theta (DSpark's walk, exactly).
"""

from __future__ import annotations

import itertools
import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Callable


class SpsProfile:
    """SPS(B) from measured points: step time is interpolated linearly between them and
    extrapolated from the last two beyond the largest. Times are made non-decreasing in B (a
    running maximum), since more tokens never cost less: a noisy point cannot invert the curve.

    The points measured at start-up are refined by the steps the engine then runs
    (``observe``): a point with ``MIN_OBSERVED`` recent step times takes their median, and the
    others move with the 1-token point's drift, so the curve follows the load the steps really
    run under instead of one start-up snapshot (on a shared CPU that snapshot priced the first
    span token at +50% where the steps beside it ran at +16%). Every span point is also priced
    at no more than an observed point with more tokens: the scheduler never picks a size it
    over-prices, so without that bound no step would ever correct it, while an under-priced
    size is picked, observed and corrected within ``MIN_OBSERVED`` steps. That holds for an
    observed point too: a few slow steps can over-price it for good, and through the running
    maximum every larger size with it, beside larger steps observed cheaper (a bf16 agent run
    then verified nothing of drafts with a low first confidence: README, "Measured figures")."""

    RECENT = 16  # step times kept per point
    MIN_OBSERVED = 3

    def __init__(self, tokens: list[int], steps_per_s: list[float]) -> None:
        if not tokens or len(tokens) != len(steps_per_s) or sorted(tokens) != list(tokens):
            raise ValueError("SPS profile needs ascending token counts, one rate each")
        if any(s <= 0 for s in steps_per_s):
            raise ValueError("SPS rates must be positive")
        self.tokens = list(tokens)
        self.measured = [1.0 / s for s in steps_per_s]
        self.recent: list[deque[float]] = [deque(maxlen=self.RECENT) for _ in tokens]
        self._refresh()

    def observe(self, b: int, seconds: float) -> None:
        """A step of ``b`` tokens took ``seconds`` (ignored unless ``b`` is a profiled point)."""
        if b in self.tokens:
            self.recent[self.tokens.index(b)].append(seconds)
            self._refresh()

    def _refresh(self) -> None:
        seen = [statistics.median(r) if len(r) >= self.MIN_OBSERVED else None for r in self.recent]
        drift = 1.0 if seen[0] is None else seen[0] / self.measured[0]
        points = [m * drift if s is None else s for m, s in zip(self.measured, seen)]
        cap = float("inf")  # the cheapest observed step with more tokens
        for i in reversed(range(1, len(points))):  # the 1-token point is the drift's reference
            points[i] = min(points[i], cap)
            if seen[i] is not None:
                cap = points[i]
        self.seconds = list(itertools.accumulate(points, max))

    def __call__(self, b: int) -> float:
        t, s = self.tokens, self.seconds
        if len(t) == 1 or b <= t[0]:
            return 1.0 / s[0]
        i = min(max(bisect_left(t, b), 1), len(t) - 1)
        sec = s[i - 1] + (s[i] - s[i - 1]) * (b - t[i - 1]) / (t[i] - t[i - 1])
        return 1.0 / sec


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
