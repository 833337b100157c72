"""A growing reply -> content deltas and whole tool calls, for streamed chat completions.

Content is sent while it surely is content (``ToolParser.content_end``: the text before any
call could start, with trailing whitespace held so the stream equals the non-streamed
``content``). A tool call is sent as one ``tool_calls`` delta (index, id, type, name and the
complete arguments) as soon as it is complete; at the end the final parse is authoritative
and sends whatever is left. Call ids depend only on (request id, index): see ``number_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .parsers import ToolCall, ToolOutput, ToolParser, number_calls


@dataclass
class StreamPiece:
    content: str = ""
    calls: list[tuple[int, ToolCall]] = field(default_factory=list)  # (index, call)


class ToolCallStream:
    def __init__(self, parser: ToolParser, request_id: str, prefix: str = "call_",
                 limit: int | None = None) -> None:
        self.parser = parser
        self.request_id, self.prefix, self.limit = request_id, prefix, limit
        self.text = ""
        self.sent_content = ""
        self.num_sent_calls = 0

    def push(self, delta: str) -> StreamPiece:
        self.text += delta
        out = self.parser.parse(self.text, final=False)
        content = "" if out.calls else self.text[:self.parser.content_end(self.text)].strip()
        return StreamPiece(self._content_delta(content), self._new_calls(out))

    def finish(self, final: ToolOutput) -> StreamPiece:
        """The rest of the reply; ``final`` (the parse of the engine's text) is authoritative."""
        return StreamPiece(self._content_delta(final.content), self._new_calls(final))

    def _content_delta(self, content: str) -> str:
        if not content.startswith(self.sent_content):
            return ""  # never resend: content already sent stays as it was
        d = content[len(self.sent_content):]
        self.sent_content = content
        return d

    def _new_calls(self, out: ToolOutput) -> list[tuple[int, ToolCall]]:
        calls = number_calls(out.calls, self.request_id, self.prefix, self.limit)
        new = list(enumerate(calls))[self.num_sent_calls:]
        self.num_sent_calls = len(calls)
        return new
