"""Which worker a conversation lives on, told from its prompts alone.

A conversation's next turn (chat history, an agent's next step) is its previous prompt plus
the reply and new text, so its page hashes contain the previous prompt's last full page. The
router records that page (the prompt's *tail*) with the worker it sent the request to; a
request whose hashes contain a recorded tail continues that conversation there. A shared
prefix alone (a system prompt, tool specs) is never a tail: it ends where each prompt's own
text begins, so a new conversation is placed by cost, not by stickiness.

Why stickiness and not a larger overlap weight: a conversation's pages serve only its own
next turns, so moving it recomputes them *and* leaves a dead copy filling the old worker's
pool, which costs later turns their hits (``policy.py`` keeps it unless the load gap is large).
A weight large enough for that would also pile new conversations onto whichever worker first
cached their shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Conversations:
    """Tail page hash -> worker, the most recent ``capacity`` tails (a finished conversation's
    tail is never looked up again; the oldest go first)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._tails: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    def holder(self, hashes: Sequence[bytes]) -> str | None:
        """The URL of the worker the latest turn this prompt continues went to (its longest
        recorded tail)."""
        for h in reversed(hashes):
            worker = self._tails.get(h)
            if worker is not None:
                return worker
        return None

    def record(self, hashes: Sequence[bytes], worker: str) -> None:
        """A prompt of ``hashes`` went to ``worker``: its tail now points there."""
        if not hashes:
            return
        tail = hashes[-1]
        self._tails.pop(tail, None)
        self._tails[tail] = worker
        while len(self._tails) > self.capacity:
            self._tails.popitem(last=False)
