"""Streaming text out of generated token ids.

Two rules for every streamed chunk:

* never emit broken UTF-8: a token can end in the middle of a multi-byte character, which
  decodes to U+FFFD; such text is held until the character completes;
* never let a stop string leak: the engine stops *after* the token that completes a stop
  string, and the string is cut from the reply, so the last ``len(longest stop) - 1``
  characters are held back until the engine says whether they start a stop string.

The final text (``RequestOutput.text``, cut at the stop string) is authoritative: when the
request finishes, whatever of it was not sent yet is sent, so the concatenated chunks equal
the non-streamed reply.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of token ids to text deltas, a few tokens of context at a time."""

    def __init__(self, tokenizer, prompt_ids: list[int], context: int = 4) -> None:
        self.tokenizer = tokenizer
        # The last prompt tokens give the first generated ones their context (e.g. a
        # SentencePiece leading space), without being emitted themselves.
        self.ids: list[int] = list(prompt_ids[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT) and full.startswith(prefix):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""


class TextStream:
    """What to send of a reply so far: decoded deltas minus the held-back tail."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded so far
        self.sent = ""  # sent so far (a prefix of ``text``)

    def push(self, new_ids: list[int]) -> str:
        self.text += self.detok.push(new_ids)
        end = len(self.text) - self.holdback
        if end <= len(self.sent):
            return ""
        out = self.text[len(self.sent):end]
        self.sent += out
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the reply once the engine is done (``final_text`` is authoritative)."""
        if final_text.startswith(self.sent):
            out = final_text[len(self.sent):]
            self.sent = final_text
            return out
        return ""  # cannot happen with a consistent tokenizer: never resend text
