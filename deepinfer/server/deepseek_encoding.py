"""DeepSeek-V4 / V4.1 chats through ``deepseek-recipe``: prompts in the official encoding's exact
token ids, replies parsed by its ``StreamProcessor`` into reasoning, content and DSML tool calls.

Chosen for a ``DeepseekV4ForCausalLM`` / ``DeepseekV41ForCausalLM`` checkpoint (V4.1 by its architecture,
``model_type: deepseek_v41`` or CSA2's ``kv_source_layer_ids``)
unless ``--tool-call-parser`` names another family; ``--tool-call-parser deepseek_v4`` forces it.
Other models keep their HF chat templates (``prompts.py``, ``tools/``).

A request goes through the recipe's own OpenAI conversion (``ChatCompletionRequest.convert``), so
thinking on/off, ``reasoning_effort``, ``tool_choice``, ``response_format`` and missing reasoning in
history follow DeepSeek's API exactly; its errors are 400s. ``reply_grammar`` is what the
reply must follow (forced DSML calls, or reasoning then a ``response_format`` answer). The
reply is parsed from token ids (DSML markers and ``</think>`` are special tokens, which the
text stream leaves out).

Prefix stability: a remembered reply's generated ids are kept in the next turn's prompt when the
official encoding renders that reply back to the same text: tool loops (with ``tools`` the
encoding keeps every reply's reasoning) and non-thinking turns. In a thinking-mode chat without
tools the official encoding drops the reasoning of earlier replies, so the next turn hits up to
the reply's start only (reported as ``history_rewritten``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import deepseek_recipe as dr

from ..errors import RequestError
from ..kv.radix import common_len
from ..structured.spec import StructuredOutput
from .prompts import BuiltPrompt, PromptBuilder, message_bytes, reply_hasher, reply_key
from .shared_replies import SharedReplies
from .thinking import Thinking
from .tools import ToolCall, ToolOutput, ToolRequest
from .tools.dsml_grammar import V4, V41, dsml_call_grammar, dsml_reply_grammar
from .tools.parsers import DSML_PARSER, call_id
from .tools.stream import CallDelta, StreamPiece

_ALIAS = "deepinfer"  # the model name conversion is given (the server checks the client's)
_FIELDS = ("reasoning_effort", "tool_choice", "thinking", "tools", "stop", "response_format")


def recipe_version(config: dict) -> dr.ModelVersion | None:
    """The recipe's model version for a checkpoint's config (as a dict); None if not
    DeepSeek-V4."""
    archs = set(config.get("architectures") or [])
    if not archs & {"DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"}:
        return None
    v41 = ("DeepseekV41ForCausalLM" in archs or config.get("model_type") == "deepseek_v41"
           or "kv_source_layer_ids" in config or "kv_source_layers" in config)
    return dr.ModelVersion.DeepseekV41Flash if v41 else dr.ModelVersion.DeepseekV4Pro


def use_recipe(parser: str | None, config: dict) -> dr.ModelVersion | None:
    """The version to render with (``parser``: ``--tool-call-parser``), or None for the HF
    template path."""
    version = recipe_version(config)
    if parser == DSML_PARSER:
        return version or dr.ModelVersion.DeepseekV4Pro
    return version if parser in (None, "auto") else None


def _openai_message(m: dict) -> dict:
    """A normalized message in the shape the recipe's conversion reads."""
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": m["content"]}
    if role == "assistant":
        if m.get("reasoning_content") is not None:
            out["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            out["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": json.dumps(c["function"]["arguments"],
                                                      ensure_ascii=False)}}
                for c in m["tool_calls"]]
    elif role == "tool":
        out["tool_call_id"] = m["tool_call_id"]
    return out


class DeepseekChat:
    """The recipe for one checkpoint: requests -> conversations -> ids, reply ids -> pieces."""

    def __init__(self, checkpoint: Path, version: dr.ModelVersion, end_ids: Iterable[int]) -> None:
        self.tokenizer = dr.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self.end_ids = set(end_ids)  # the engine stops on them; the processor is not shown them
        v41 = version == dr.ModelVersion.DeepseekV41Flash
        enc = dr.DeepseekV41Encoding() if v41 else dr.DeepseekV4Encoding()
        self.encoding = enc.with_tokenizer(self.tokenizer)
        self.options = dr.ConversionOptions().with_model_alias(_ALIAS, version)
        self.syntax = V41 if v41 else V4
        self.dsml = self._marker(dr.SpecialToken.Dsml)
        self.think_end = self._marker(dr.SpecialToken.ThinkingEnd)

    def _marker(self, token: dr.SpecialToken) -> str:
        """A special token as a Lark item: its id when it is one token (which text cannot
        fake), else its spelling."""
        spelling = self.options.special_tokens.token(token)
        ids = list(self.tokenizer.encode(spelling))
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(spelling, ensure_ascii=False)

    def convert(self, messages: list[dict], tools: ToolRequest, thinking: Thinking,
                stop: list[str] | None = None,
                response_format: dict | None = None) -> dr.ConversationRequest:
        """``response_format`` as the client sent it (checked by the protocol): the encoding
        renders it into the system prompt, in the client's key order."""
        body: dict = {"model": _ALIAS, "messages": [_openai_message(m) for m in messages]}
        if tools.tools:
            body["tools"] = tools.tools
            body["tool_choice"] = tools.choice if tools.choice != "function" else \
                {"type": "function", "function": {"name": tools.function_name}}
        if thinking.enabled is not None:
            body["thinking"] = {"type": "enabled" if thinking.enabled else "disabled"}
        if thinking.effort is not None:
            body["reasoning_effort"] = thinking.effort
        if stop:
            body["stop"] = stop
        if response_format is not None:
            body["response_format"] = response_format
        try:
            return dr.ChatCompletionRequest(body).convert(self.options)
        except (ValueError, dr.ConversionError) as e:
            raise RequestError(self._blame(body), str(e)) from None

    def reply_grammar(self, messages: list[dict], tools: ToolRequest, thinking: Thinking,
                      response_format: dict | None = None) -> StructuredOutput | None:
        """The grammar of the reply, or None when it is free: calls after the DSML call block
        the prompt opens (``tool_choice`` required / named), or an answer that follows a JSON
        ``response_format`` after free reasoning (thinking on), where ``tool_choice`` auto
        leaves a call block as the other branch."""
        request = self.convert(messages, tools, thinking, None, response_format)
        constraint = request.inference_options.output_constraint
        if constraint is None:
            return None
        where = {t["function"]["name"]: f"tools[{i}].function" for i, t in enumerate(tools.tools)}
        listed = json.loads(constraint.schema) if constraint.kind.startswith("tool_call") else []
        wheres = [where.get(t["function"]["name"], "tools") for t in listed]
        if constraint.kind == "tool_call_required":
            return StructuredOutput.lark(dsml_call_grammar(self.syntax, self.dsml, listed,
                                                           tools.parallel, wheres))
        conv = request.conversation
        if conv.response_format not in ("json_object", "json_schema"):
            return None  # tool_choice auto without a format: calls or text, unconstrained
        schema = conv.response_schema if conv.response_format == "json_schema" \
            else {"type": "object"}
        thinks = request.parsing_options.thinking_initial_stage is not None
        return StructuredOutput.lark(dsml_reply_grammar(
            self.syntax, self.dsml, self.think_end if thinks else None, schema, listed,
            tools.parallel, wheres))

    def _blame(self, body: dict) -> str:
        """The request field a rejected conversion is about: the first one whose removal makes
        the request pass (the recipe's messages do not always name it)."""
        for f in _FIELDS:
            if f in body:
                try:
                    dr.ChatCompletionRequest({k: v for k, v in body.items() if k != f}) \
                        .convert(self.options)
                    return f
                except (ValueError, dr.ConversionError):
                    pass
        return "messages"

    def encode(self, request: dr.ConversationRequest) -> list[int]:
        return list(self.encoding.encode(request.conversation))

    def reply_stream(self, request: dr.ConversationRequest, request_id: str,
                     prefix: str = "call_", limit: int | None = None) -> DeepseekReplyStream:
        return DeepseekReplyStream(self, request, request_id, prefix, limit)

    def parse(self, request: dr.ConversationRequest, token_ids: list[int], request_id: str,
              prefix: str = "call_", limit: int | None = None) -> ToolOutput:
        """A whole reply: reasoning, content and calls, as the stream of it adds up to."""
        stream = self.reply_stream(request, request_id, prefix, limit)
        pieces = [stream.push("", token_ids), stream.finish(None, [])]
        content = "".join(p.content for p in pieces)
        reasoning = "".join(p.reasoning for p in pieces)
        calls: dict[int, list[str]] = {}
        for d in (d for p in pieces for d in p.calls):
            name_args = calls.setdefault(d.index, ["", ""])
            name_args[0] += d.name or ""
            name_args[1] += d.arguments
        out = []
        for i in sorted(calls):
            name, text = calls[i]
            try:
                args = json.loads(text)
            except ValueError:
                args = None
            call = ToolCall(name, args if isinstance(args, dict) else {}, arguments_text=text)
            call.id = call_id(request_id, i, prefix)
            out.append(call)
        return ToolOutput(content, out, reasoning if stream.thinking else None)


class DeepseekReplyStream:
    """Reply token ids -> content, reasoning and ``tool_calls`` deltas (arguments as the
    processor emits them, token by token); call ids from (request id, index) as elsewhere."""

    def __init__(self, chat: DeepseekChat, request: dr.ConversationRequest, request_id: str,
                 prefix: str, limit: int | None) -> None:
        options = request.parsing_options
        self.thinking = options.thinking_initial_stage is not None
        gen = dr.ChatCompletionRequest.chunk_generator(request, request_id, _ALIAS)
        self._proc = dr.StreamProcessor(gen, options, chat.tokenizer)
        self._proc.push(dr.InferenceChunk.ready())  # the role chunk: the server sends its own
        self.request_id, self.prefix, self.limit = request_id, prefix, limit
        self.end_ids = chat.end_ids

    def push(self, text: str, token_ids: list[int]) -> StreamPiece:
        """``text`` is not read: DSML markers are special tokens, so the ids are parsed."""
        return self._piece(self._tokens(token_ids))

    def finish(self, final: ToolOutput | None, token_ids: list[int]) -> StreamPiece:
        """The last ids and whatever the processor held back (``final`` is not needed: this
        stream's own parse is the final one)."""
        chunks = self._tokens(token_ids)
        if not self._proc.finished:
            chunks += self._proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
            chunks += self._proc.finish()
        return self._piece(chunks)

    def _tokens(self, token_ids: list[int]) -> list[dr.ChatCompletionChunk]:
        """One chunk per token: the processor decodes a chunk as a unit (one that is not valid
        UTF-8 yet is held whole), so this keeps a stream's split independent of how the
        engine's deltas were grouped, and equal to the whole reply's."""
        return [c for t in token_ids if t not in self.end_ids
                for c in self._proc.push(dr.InferenceChunk.tokens([t]))]

    def _piece(self, chunks: list[dr.ChatCompletionChunk]) -> StreamPiece:
        piece = StreamPiece()
        for chunk in chunks:
            for choice in json.loads(chunk.to_json())["choices"]:
                delta = choice.get("delta") or {}
                piece.content += delta.get("content") or ""
                piece.reasoning += delta.get("reasoning_content") or ""
                for c in delta.get("tool_calls") or []:
                    i = c["index"]
                    if self.limit is not None and i >= self.limit:
                        continue
                    fn = c.get("function") or {}
                    cid = call_id(self.request_id, i, self.prefix) if c.get("id") else None
                    piece.calls.append(CallDelta(i, fn.get("arguments") or "", cid,
                                                 fn.get("name")))
        return piece


class DeepseekPromptBuilder(PromptBuilder):
    """``PromptBuilder`` with the recipe's encoding in place of the chat template."""

    def __init__(self, chat: DeepseekChat, tokenizer, end_ids, max_tokens: int,
                 shared: SharedReplies | None = None) -> None:
        super().__init__(tokenizer, end_ids, max_tokens, shared)
        self.recipe = chat

    def chat(self, messages: list[dict], salt: str | None, tools: list[dict] | None = None,
             tool_request: ToolRequest | None = None, thinking: Thinking = Thinking(),
             response_format: dict | None = None) -> BuiltPrompt:
        tool_request = tool_request or ToolRequest(tools or [])
        fresh = self.recipe.encode(self.recipe.convert(messages, tool_request, thinking, None,
                                                       response_format))
        h = reply_hasher(salt, tool_request.tools)
        found = None
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                rec = self.replies.get(reply_key(h, m))
                found = (i, rec) if rec is not None else found
            h.update(message_bytes(m))
        if found is None:
            return BuiltPrompt(fresh, "rendered", key_state=h)
        prev_ids, reply_ids = found[1]
        ids = self._extend(fresh, prev_ids, reply_ids)
        if ids is None:  # the encoding renders that reply (or what precedes it) differently
            return BuiltPrompt(fresh, "rendered", True, key_state=h)
        return BuiltPrompt(ids, "extended", False, common_len(ids, prev_ids + reply_ids),
                           key_state=h)

    def _extend(self, fresh: list[int], prev_ids: list[int],
                reply_ids: list[int]) -> list[int] | None:
        """``prev_ids + reply_ids + the rest of fresh`` when ``fresh`` holds ``prev_ids`` and then
        the reply rendered as the same text up to its end token, else None. A reply cut short
        (no end token) takes the end token the encoding closes it with."""
        n = len(prev_ids)
        if fresh[:n] != prev_ids:
            return None
        end = next((k for k in range(n, len(fresh)) if fresh[k] in self.end_ids), None)
        body = reply_ids[:-1] if reply_ids and reply_ids[-1] in self.end_ids else reply_ids
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        if end is None or dec(fresh[n:end]) != dec(body):
            return None
        return prev_ids + body + fresh[end:]

    def remember(self, key_state, prompt_ids: list[int], reply_ids: list[int],
                 message: dict) -> None:
        """The whole generated reply is kept: ``_extend`` checks it against the encoding."""
        self.replies.put(reply_key(key_state, message), prompt_ids, list(reply_ids))
