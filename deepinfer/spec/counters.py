"""Speculation counters, per request (``Request.spec``) and per draft source (engine metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecCounters:
    source: str = ""  # the draft source ("" for a request never offered a draft)
    drafted: int = 0  # tokens the draft source proposed
    verified: int = 0  # of those, tokens put in a verify span
    accepted: int = 0  # verified tokens the target model agreed with
    steps: int = 0  # steps that verified at least one draft token

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per verify step."""
        return self.accepted / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, str | int | float]:
        """The ``speculative`` object of a response's usage."""
        return {"source": self.source, "drafted_tokens": self.drafted,
                "verified_tokens": self.verified, "accepted_tokens": self.accepted,
                "verify_steps": self.steps, "mean_accepted_tokens": round(self.mean_accepted, 4)}
