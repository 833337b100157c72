"""A growing reply -> content deltas and OpenAI-shaped ``tool_calls`` deltas, for streamed
chat completions.

Content is sent while it surely is content (``ToolParser.content_end``: the text before any
call could start, with trailing whitespace held so the stream equals the non-streamed
``content``). A tool call is announced (index, id, type, name) once its name is written, and
its arguments follow as fragments while the model writes them (``ToolParser.partial_call``:
the valid JSON written so far), adding up to the call's arguments as written; at the end the
final parse is authoritative and sends whatever is left. A call whose JSON breaks after it
was announced cannot be taken back (as in vLLM). Call ids depend only on (request id, index):
see ``number_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .parsers import ToolOutput, ToolParser, call_id, number_calls


@dataclass
class CallDelta:
    """One OpenAI ``tool_calls`` delta: a call's first names it (``id``, ``name``); the
    ``arguments`` fragments of a call add up to its complete arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        fn = {"arguments": self.arguments} if self.name is None else \
            {"name": self.name, "arguments": self.arguments}
        head = {"index": self.index} if self.id is None else \
            {"index": self.index, "id": self.id, "type": "function"}
        return {**head, "function": fn}


@dataclass
class StreamPiece:
    content: str = ""
    reasoning: str = ""  # a thinking model's reasoning (DeepSeek-V4)
    calls: list[CallDelta] = field(default_factory=list)


class ReplyStream(Protocol):
    """A streamed reply split as its final parse splits it (``ToolCallStream`` over text;
    DeepSeek-V4's ``DeepseekReplyStream`` over token ids)."""

    def push(self, delta: str, token_ids: list[int]) -> StreamPiece: ...

    def finish(self, final: ToolOutput | None, token_ids: list[int]) -> StreamPiece: ...


class ToolCallStream:
    def __init__(self, parser: ToolParser, request_id: str, prefix: str = "call_",
                 limit: int | None = None) -> None:
        self.parser = parser
        self.request_id, self.prefix, self.limit = request_id, prefix, limit
        self.text = ""
        self.sent_content = ""
        self.sent_args: list[str] = []  # per call index: the arguments text sent so far

    def push(self, delta: str, token_ids: list[int] | None = None) -> StreamPiece:
        """``delta``: the reply's new text (these parsers read text, not ``token_ids``)."""
        self.text += delta
        out = self.parser.parse(self.text, final=False)
        content = "" if out.calls else self.text[:self.parser.content_end(self.text)].strip()
        calls = self._call_deltas(out)
        partial = self.parser.partial_call(self.text)
        if partial is not None:
            calls += self._advance(len(out.calls), *partial)
        return StreamPiece(self._content_delta(content), calls=calls)

    def finish(self, final: ToolOutput, token_ids: list[int] | None = None) -> StreamPiece:
        """The rest of the reply; ``final`` (the parse of the engine's text) is authoritative."""
        return StreamPiece(self._content_delta(final.content), calls=self._call_deltas(final))

    def _content_delta(self, content: str) -> str:
        if not content.startswith(self.sent_content):
            return ""  # never resend: content already sent stays as it was
        d = content[len(self.sent_content):]
        self.sent_content = content
        return d

    def _call_deltas(self, out: ToolOutput) -> list[CallDelta]:
        calls = number_calls(out.calls, self.request_id, self.prefix, self.limit)
        return [d for i, c in enumerate(calls) for d in self._advance(i, c.name, c.arguments_json)]

    def _advance(self, index: int, name: str, arguments: str) -> list[CallDelta]:
        """What call ``index`` adds to what was sent of it: its header (id, name) and the new
        part of its arguments."""
        if (self.limit is not None and index >= self.limit) or index > len(self.sent_args):
            return []
        if index == len(self.sent_args):
            self.sent_args.append(arguments)
            return [CallDelta(index, arguments, call_id(self.request_id, index, self.prefix),
                              name)]
        sent = self.sent_args[index]
        if not arguments.startswith(sent) or arguments == sent:
            return []
        self.sent_args[index] = arguments
        return [CallDelta(index, arguments[len(sent):])]
