"""How a chat request's prompt is built and its reply parsed: DeepSeek-V4 through
``deepseek-recipe`` (``deepseek_encoding.py``), other models through their chat template
(``prompts.py``) and a tool-call parser (``tools/``)."""

from __future__ import annotations

from ..engine import LLMEngine
from ..structured.spec import StructuredOutput
from .api_error import APIError
from .config import ServerConfig
from .deepseek_encoding import DeepseekChat, DeepseekPromptBuilder, use_recipe
from .prompts import BuiltPrompt, PromptBuilder
from .protocol import ParsedRequest
from .shared_replies import SharedReplies
from .tools import ToolCallStream, ToolOutput, ToolParser, number_calls, resolve_parser
from .tools.answer_or_calls import AnswerOrCallsParser, answer_or_calls_grammar
from .tools.stream import ReplyStream


class ReplyFormat:
    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        version = use_recipe(config.tool_call_parser, engine.hf_config.to_dict())
        self.recipe = DeepseekChat(engine.checkpoint_path, version, engine.eos_token_ids) \
            if version else None
        self.tool_parser: ToolParser | None = None if self.recipe else \
            resolve_parser(config.tool_call_parser, engine.tokenizer.chat_template)
        self.tokenizer = engine.tokenizer

    def builder(self, end_ids, max_tokens: int, shared: SharedReplies | None = None
                ) -> PromptBuilder:
        if self.recipe is None:
            return PromptBuilder(self.tokenizer, end_ids, max_tokens, shared)
        return DeepseekPromptBuilder(self.recipe, self.tokenizer, end_ids, max_tokens, shared)

    def prompt(self, builder: PromptBuilder, p: ParsedRequest) -> BuiltPrompt:
        if self.recipe is None:
            if p.tools.tools and self.tool_parser is None:
                raise APIError(400, "tools: the model's chat template does not render tools; "
                                    "start the server with --chat-template FILE (a template "
                                    "that does) or --tool-call-parser", param="tools")
            return builder.chat(p.messages, p.cache_salt, p.tools.tools)
        return builder.chat(p.messages, p.cache_salt, p.tools.tools, p.tools, p.thinking,
                            p.response_format)

    def constraint(self, p: ParsedRequest, added_tokens: dict[str, int]) -> StructuredOutput | None:
        """The grammar of a chat reply: with the recipe, its whole reply (DSML calls after the
        call block its prompt opens, or reasoning then a ``response_format`` answer); else the
        parser family's call syntax when the reply must be calls, ``response_format``, or
        (``tool_choice`` auto with ``response_format``) either (``tools/answer_or_calls.py``)."""
        so = p.params.structured_output
        if not p.tools.forced and so is None:
            return None
        if self.recipe is not None:
            return self.recipe.reply_grammar(p.messages, p.tools, p.thinking, p.response_format)
        if not p.tools.parse_calls:
            return so
        schema = p.tools.call_schema(self.tool_parser.ARGS_KEY)
        if not p.tools.forced:
            return StructuredOutput.lark(answer_or_calls_grammar(
                self.tool_parser, so, schema, p.tools.parallel, added_tokens))
        return StructuredOutput.lark(self.tool_parser.call_grammar(schema, p.tools.parallel,
                                                                   added_tokens))

    def _parser(self, p: ParsedRequest) -> ToolParser:
        """The family's parser; with ``response_format`` (``tool_choice`` auto) the one that
        tells its answer from its calls."""
        if p.params.structured_output is not None and not p.tools.forced:
            return AnswerOrCallsParser(self.tool_parser)
        return self.tool_parser

    def parses(self, p: ParsedRequest) -> bool:
        """Is a chat reply split (content, reasoning, calls)? Always with the recipe."""
        return p.kind == "chat" and (self.recipe is not None or p.tools.parse_calls)

    def final(self, p: ParsedRequest, request_id: str, text: str,
              token_ids: list[int]) -> ToolOutput | None:
        """The whole reply, parsed (None: plain text)."""
        if not self.parses(p):
            return None
        limit = None if p.tools.parallel else 1
        if self.recipe is not None:
            conv = self.recipe.convert(p.messages, p.tools, p.thinking, p.params.stop,
                                       p.response_format)
            return self.recipe.parse(conv, token_ids, request_id, p.tool_call_prefix, limit)
        out = self._parser(p).parse(text)
        out.calls = number_calls(out.calls, request_id, p.tool_call_prefix, limit)
        return out

    def stream(self, p: ParsedRequest, request_id: str) -> ReplyStream | None:
        """Splits a streamed reply as ``final`` splits the whole one (None: plain text)."""
        if not self.parses(p):
            return None
        limit = None if p.tools.parallel else 1
        if self.recipe is not None:
            conv = self.recipe.convert(p.messages, p.tools, p.thinking, p.params.stop,
                                       p.response_format)
            return self.recipe.reply_stream(conv, request_id, p.tool_call_prefix, limit)
        return ToolCallStream(self._parser(p), request_id, p.tool_call_prefix, limit)
