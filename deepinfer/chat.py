"""Prefix-stable chat encoding: turn k+1's prompt is turn k's prompt + reply tokens + new turn.

Re-tokenising a conversation's text each turn can change earlier token ids (a reply's text
need not tokenise back to the ids that were generated), and some templates rewrite history
(e.g. drop earlier reasoning); either way the cache stops hitting at the first changed token.
``extend_prompt`` keeps the generated ids and tokenises only the text the template adds
after them, and says when the template rewrote history so the caller can report it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """The chat template's text; ``tools`` (OpenAI function tools) go to the template's own
    ``tools`` argument, so the model sees them the way it was trained to."""
    if not messages:
        raise ValueError("messages must not be empty")
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    return encode_text(tokenizer, render_text(tokenizer, messages))


@dataclass
class Extension:
    token_ids: list[int]
    history_rewritten: bool  # True: the template changed earlier turns; prefix reuse stops there


def extend_prompt(tokenizer, prev_messages: list[dict], prev_prompt_ids: list[int],
                  reply_ids: list[int], messages: list[dict],
                  end_ids: Iterable[int] = (), tools: list[dict] | None = None) -> Extension:
    """Token ids of ``messages`` that extend ``prev_prompt_ids + reply_ids`` where possible.

    ``prev_messages`` rendered to ``prev_prompt_ids``; ``reply_ids`` were generated after it
    (ending with an end-of-turn id from ``end_ids`` when the model stopped by itself).
    """
    base = render_text(tokenizer, prev_messages, tools=tools)
    full = render_text(tokenizer, messages, tools=tools)
    end_ids = set(end_ids)
    body = reply_ids[:-1] if reply_ids and reply_ids[-1] in end_ids else reply_ids
    reply_text = tokenizer.decode(body, skip_special_tokens=False)
    if full.startswith(base) and full[len(base):].startswith(reply_text):
        rest = full[len(base) + len(reply_text):]
        ids = prev_prompt_ids + body
        if len(body) < len(reply_ids):  # keep the generated end token if the template has it
            end_text = tokenizer.decode(reply_ids[-1:], skip_special_tokens=False)
            if rest.startswith(end_text):
                ids.append(reply_ids[-1])
                rest = rest[len(end_text):]
        return Extension(ids + encode_text(tokenizer, rest), history_rewritten=False)
    return Extension(encode_text(tokenizer, full), history_rewritten=True)


@dataclass
class ChatSession:
    """A conversation held as token ids, for the offline API and the interactive CLI."""

    tokenizer: object
    end_ids: set[int]
    messages: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    reply_ids: list[int] = field(default_factory=list)
    history_rewrites: int = 0
    _prompt_messages: list[dict] = field(default_factory=list)

    def next_prompt(self, user_text: str) -> list[int]:
        new_messages = self.messages + [{"role": "user", "content": user_text}]
        if not self.prompt_ids:
            ids = render_chat(self.tokenizer, new_messages)
        else:
            ext = extend_prompt(self.tokenizer, self._prompt_messages, self.prompt_ids,
                                self.reply_ids, new_messages, self.end_ids)
            self.history_rewrites += ext.history_rewritten
            ids = ext.token_ids
        self._prompt_messages = new_messages
        self.messages = new_messages
        self.prompt_ids = ids
        return ids

    def add_reply(self, reply_ids: list[int], reply_text: str) -> None:
        self.reply_ids = list(reply_ids)
        self.messages = self.messages + [{"role": "assistant", "content": reply_text}]
