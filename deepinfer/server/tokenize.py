"""``POST /tokenize`` and ``POST /detokenize``, shaped as vLLM's.

``/tokenize`` takes ``prompt`` (text; ``add_special_tokens``, default true) or chat
``messages`` (plus ``tools``; ``add_generation_prompt``, default true) and answers
``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` with ``return_token_strs``).
Chat messages go through the same prompt builder as a real request, so the ids are exactly
the prompt the server would run, prefix-stable encoding included. Both run on the engine
thread: the tokenizer is not shared across threads.
"""

from __future__ import annotations

from ..limits import is_int
from .api_error import bad
from .async_engine import AsyncEngine
from .chat_messages import normalize_messages
from .protocol import tool_request
from .request_fields import get_bool, get_str


def tokenize(eng: AsyncEngine, body: dict) -> dict:
    tok = eng.tokenizer
    if "messages" in body:
        messages = normalize_messages(body.get("messages"))
        tools = tool_request(body).tools
        salt = get_str(body, "cache_salt")
        if get_bool(body, "add_generation_prompt", True):
            ids = eng.builder.chat(messages, salt, tools).token_ids
        else:
            text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt = get_str(body, "prompt")
        if prompt is None:
            raise bad("prompt", "give 'prompt' (text) or 'messages' (chat)")
        ids = tok.encode(prompt, add_special_tokens=get_bool(body, "add_special_tokens", True))
    out = {"count": len(ids), "max_model_len": eng.engine.max_model_len, "tokens": ids}
    if get_bool(body, "return_token_strs"):
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


def detokenize(eng: AsyncEngine, body: dict) -> dict:
    ids = body.get("tokens")
    vocab = eng.engine.hf_config.vocab_size
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
        raise bad("tokens", f"must be an array of token ids in [0, {vocab})")
    return {"prompt": eng.tokenizer.decode(ids)}
