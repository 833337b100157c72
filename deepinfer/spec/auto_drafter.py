"""The ``auto`` draft source: every weight-free source proposes, the calibrated best one drafts.

Prompt lookup wins where a reply copies its own prompt (code edits, quoted tool outputs); the
shared suffix index wins where requests repeat each other (agent loops, later turns). Neither
is better everywhere, and their features mean different things, so each keeps its own
calibration bins (the drafts keep their source's name) and the choice per request and step is
the draft with the higher expected number of accepted tokens, sum_j a_j, under the calibrator
the verifier trains. A source that keeps losing its verifications stops being chosen by itself.
"""

from __future__ import annotations

from .calibration import Calibrator
from .drafters import Draft, TokenDrafter


class AutoDrafter(TokenDrafter):
    name = "auto"

    def __init__(self, sources: list[TokenDrafter], calibrator: Calibrator) -> None:
        self.sources = sources
        self.calibrator = calibrator

    def propose(self, tokens: list[int], k: int) -> Draft:
        """The draft with the highest expected accepted length; ties go to the earlier source,
        and a request no source has a draft for gets an empty one."""
        best, best_value = Draft(self.name), 0.0
        for source in self.sources:
            d = source.propose(tokens, k)
            value = sum(self.calibrator.survival(d.source, d.features))
            if value > best_value:
                best, best_value = d, value
        return best

    def observe(self, tokens: list[int], start: int = 0) -> None:
        for source in self.sources:
            source.observe(tokens, start)
