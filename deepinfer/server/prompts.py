"""Prompt token ids for HTTP requests, prefix-stable across the turns of a conversation.

A chat client resends the whole conversation every turn, as text. Re-tokenising it can
change the token ids of earlier replies (a reply's text need not tokenise back to the ids
that were generated), and the prefix cache stops hitting at the first changed id. So the
server remembers, for each recent reply, the prompt ids it was generated from and the
generated ids, keyed by a hash of (cache salt, tools, the messages of that request, the reply
message: its text and tool calls, as normalized by the protocol).
When a new request contains an assistant message found in that record, its prompt is built
with ``deepinfer.chat.extend_prompt``: the old prompt ids + the generated ids + only the
text the template adds after them, tokenised.

Outcomes (``BuiltPrompt.encoding``):

* ``extended``: prompt = earlier prompt + generated reply + new turns (best case);
* ``extended_prompt``: the template renders the reply differently from the generated ids
  (e.g. a special token the client never saw); the earlier prompt ids are kept;
* ``rendered``: no known reply in the conversation, or the template rewrote earlier turns
  (``history_rewritten``: e.g. it drops the reasoning of past replies) — the whole
  conversation is tokenised afresh and the cache hits only up to the first changed token;
* ``text`` / ``tokens``: a completions prompt, as given.

All of this runs on the engine thread (the tokenizer is not shared across threads).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..chat import encode_text, extend_prompt, render_text
from ..kv.radix import common_len
from .shared_replies import SharedReplies

_MAX_LOOKBACK = 8  # assistant messages looked up, newest first


@dataclass
class BuiltPrompt:
    token_ids: list[int]
    encoding: str
    history_rewritten: bool = False
    reused_tokens: int = 0  # leading ids taken from an earlier request's prompt + reply
    key_state: object | None = None  # hash of (salt, messages): the reply record's key prefix


class ReplyCache:
    """LRU map: reply key -> (prompt ids, reply ids), bounded by the tokens it holds; with
    ``shared``, records also go to (and are looked up in) the networked store."""

    def __init__(self, max_tokens: int, shared: SharedReplies | None = None) -> None:
        self.max_tokens = max_tokens
        self.shared = shared
        self.tokens = 0
        self._d: OrderedDict[bytes, tuple[array, array]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def put(self, key: bytes, prompt_ids: list[int], reply_ids: list[int]) -> None:
        if self.shared is not None:
            self.shared.put(key, prompt_ids, reply_ids)
        self._put_local(key, prompt_ids, reply_ids)

    def _put_local(self, key: bytes, prompt_ids: list[int], reply_ids: list[int]) -> None:
        if key in self._d:
            self._drop(key)
        p, r = array("i", prompt_ids), array("i", reply_ids)  # 4 bytes a token
        self._d[key] = (p, r)
        self.tokens += len(p) + len(r)
        while self.tokens > self.max_tokens and self._d:
            self._drop(next(iter(self._d)))

    def get(self, key: bytes) -> tuple[list[int], list[int]] | None:
        v = self._d.get(key)
        if v is None:
            rec = self.shared.get(key) if self.shared is not None else None
            if rec is not None:
                self._put_local(key, *rec)
            return rec
        self._d.move_to_end(key)
        return v[0].tolist(), v[1].tolist()

    def _drop(self, key: bytes) -> None:
        p, r = self._d.pop(key)
        self.tokens -= len(p) + len(r)


def reply_hasher(salt: str | None, tools: list[dict] | None):
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer-reply")
    h.update(json.dumps(salt).encode() + b"\n")
    h.update(json.dumps(tools or None, ensure_ascii=False, sort_keys=True).encode() + b"\n")
    return h


def message_bytes(m: dict) -> bytes:
    return json.dumps(m, ensure_ascii=False, sort_keys=True).encode() + b"\n"


def reply_key(key_state, message: dict) -> bytes:
    """Key of an assistant ``message`` (normalized) that followed the messages in ``key_state``."""
    h = key_state.copy()
    h.update(b"reply:" + message_bytes(message))
    return h.digest()


class PromptBuilder:
    def __init__(self, tokenizer, end_ids, max_tokens: int,
                 shared: SharedReplies | None = None) -> None:
        self.tokenizer = tokenizer
        self.end_ids = set(end_ids)
        self.replies = ReplyCache(max_tokens, shared)

    # ------------------------------------------------------------------ building
    def completion(self, prompt: str | list[int]) -> BuiltPrompt:
        if isinstance(prompt, str):
            return BuiltPrompt(encode_text(self.tokenizer, prompt), "text")
        return BuiltPrompt(list(prompt), "tokens")

    def chat(self, messages: list[dict], salt: str | None,
             tools: list[dict] | None = None) -> BuiltPrompt:
        """Prompt ids of ``messages`` (and ``tools``, rendered by the template); extends a
        remembered earlier turn where one is found."""
        h = reply_hasher(salt, tools)
        states = []  # (index of an assistant message, hash of the messages before it)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                states.append((i, h.copy()))
            h.update(message_bytes(m))
        found = None
        for j, st in reversed(states[-_MAX_LOOKBACK:]):
            rec = self.replies.get(reply_key(st, messages[j]))
            if rec is not None:
                found = j, rec
                break
        if found is None:
            ids = encode_text(self.tokenizer, render_text(self.tokenizer, messages, tools=tools))
            return BuiltPrompt(ids, "rendered", key_state=h)
        j, (prev_ids, reply_ids) = found
        prev_messages = messages[:j]
        ext = extend_prompt(self.tokenizer, prev_messages, prev_ids, reply_ids, messages,
                            self.end_ids, tools)
        if not ext.history_rewritten:
            reused = common_len(ext.token_ids, prev_ids + reply_ids)
            return BuiltPrompt(ext.token_ids, "extended", False, reused, key_state=h)
        base = render_text(self.tokenizer, prev_messages, tools=tools)
        full = render_text(self.tokenizer, messages, tools=tools)
        if full.startswith(base):
            # Earlier turns render as before: keep their ids. Whether the reply itself was
            # rewritten (vs. merely decoding differently from its ids) decides the report.
            rewritten = not full[len(base):].startswith(messages[j]["content"])
            ids = prev_ids + encode_text(self.tokenizer, full[len(base):])
            return BuiltPrompt(ids, "extended_prompt", rewritten, len(prev_ids), key_state=h)
        return BuiltPrompt(ext.token_ids, "rendered", True, key_state=h)

    # ------------------------------------------------------------------ remembering
    def remember(self, key_state, prompt_ids: list[int], reply_ids: list[int],
                 message: dict) -> None:
        """Record a finished chat reply (``message``: the assistant message as the client will
        send it back, normalized) so the next turn can extend it token for token."""
        ids = reply_ids if message.get("tool_calls") else \
            self._reply_ids_for(reply_ids, message["content"])
        self.replies.put(reply_key(key_state, message), prompt_ids, list(ids))

    def _reply_ids_for(self, reply_ids: list[int], content: str) -> list[int]:
        """The generated ids that render as ``content`` (+ an end token), as far as possible.

        A reply cut at a stop string has ids past the cut; drop them so the ids match the
        text the client sends back.
        """
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        body = reply_ids[:-1] if reply_ids and reply_ids[-1] in self.end_ids else reply_ids
        if dec(body) == content:
            return list(reply_ids)
        for k in range(len(reply_ids) - 1, max(-1, len(reply_ids) - 32), -1):
            if dec(reply_ids[:k]) == content:
                return list(reply_ids[:k])
        return list(reply_ids)
