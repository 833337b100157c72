"""Online confidence: c = P(draft position accepted | the positions before it were), per draft
source, position and source feature, from the engine's own verification outcomes.

Each (source, position, feature) bin keeps accepted / tried counts under a Beta prior, so an
unseen bin starts at the prior mean and moves to its observed rate as outcomes arrive. The
default prior is optimistic (mean 0.9, weight 2): the scheduler only learns a bin's rate by
verifying it, so a new bin gets tried, and two rejections bring it below one half. A
rolling window of (predicted, outcome) pairs per source gives its expected calibration error
(ECE).
"""

from __future__ import annotations

from collections import deque

ECE_BINS = 10


class Calibrator:
    def __init__(self, window: int, prior_accept: float = 1.8, prior_reject: float = 0.2) -> None:
        self.prior = (prior_accept, prior_reject)
        self.counts: dict[tuple[str, int, int], list[int]] = {}  # bin -> [accepted, tried]
        self.window = window
        self.recent: dict[str, deque[tuple[float, bool]]] = {}  # source -> (predicted, outcome)

    def confidence(self, source: str, position: int, feature: int) -> float:
        acc, tried = self.counts.get((source, position, feature), (0, 0))
        a, b = self.prior
        return (acc + a) / (tried + a + b)

    def confidences(self, source: str, features: list[int]) -> list[float]:
        return [self.confidence(source, j, f) for j, f in enumerate(features)]

    def survival(self, source: str, features: list[int]) -> list[float]:
        """a_j: the probability that draft token j (and so all before it) is accepted."""
        out, a = [], 1.0
        for c in self.confidences(source, features):
            a *= c
            out.append(a)
        return out

    def update(self, source: str, features: list[int], accepted: int) -> None:
        """Record one verification of ``features`` (the verified prefix) that accepted
        ``accepted`` tokens: positions before it were accepted, the one at it rejected, those
        after it were never tried under the condition c is defined on."""
        recent = self.recent.setdefault(source, deque(maxlen=self.window))
        for j, f in enumerate(features[: accepted + 1]):
            ok = j < accepted
            recent.append((self.confidence(source, j, f), ok))
            cell = self.counts.setdefault((source, j, f), [0, 0])
            cell[0] += ok
            cell[1] += 1

    def ece(self, source: str) -> float:
        """Expected calibration error of ``source`` over its rolling window (0 when empty)."""
        recent = self.recent.get(source)
        if not recent:
            return 0.0
        bins: list[list[tuple[float, bool]]] = [[] for _ in range(ECE_BINS)]
        for p, ok in recent:
            bins[min(int(p * ECE_BINS), ECE_BINS - 1)].append((p, ok))
        total = len(recent)
        return sum(abs(sum(p for p, _ in b) - sum(ok for _, ok in b)) / total for b in bins if b)
