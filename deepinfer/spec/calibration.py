"""Online confidence: c = P(draft position accepted | the positions before it were), per draft
source, position and source feature, from the engine's own verification outcomes.

Each (source, position, feature) bin keeps accepted / tried counts, shrunk towards the rate of
its (source, position) over the other features, which in turn starts at a Beta prior: an unseen bin
starts at what its position has shown so far, not at the prior, so a workload where drafts are
rarely accepted (plain chat) stops paying to explore every new feature value, and a bin moves
to its own observed rate as its outcomes arrive. The prior is optimistic (mean 0.9, weight 2):
the scheduler only learns a rate by verifying it, so a new source and position get tried, and
two rejections bring them below one half. A rolling window of (predicted, outcome) pairs per source gives its expected calibration error
(ECE).
"""

from __future__ import annotations

from collections import deque

ECE_BINS = 10


class Calibrator:
    def __init__(self, window: int, prior_accept: float = 1.8, prior_reject: float = 0.2) -> None:
        self.prior = (prior_accept, prior_reject)
        self.counts: dict[tuple[str, int, int], list[int]] = {}  # bin -> [accepted, tried]
        self.pooled: dict[tuple[str, int], list[int]] = {}  # (source, position) -> the same
        self.window = window
        self.recent: dict[str, deque[tuple[float, bool]]] = {}  # source -> (predicted, outcome)

    def confidence(self, source: str, position: int, feature: int) -> float:
        a, b = self.prior
        acc, tried = self.counts.get((source, position, feature), (0, 0))
        p_acc, p_tried = self.pooled.get((source, position), (0, 0))
        # the bin's prior mean: the rate of the position's other features (so no outcome
        # counts twice); with none yet, the prior's own
        mean = (p_acc - acc + a) / (p_tried - tried + a + b)
        return (acc + mean * (a + b)) / (tried + a + b)

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
            for cell in (self.counts.setdefault((source, j, f), [0, 0]),
                         self.pooled.setdefault((source, j), [0, 0])):
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
