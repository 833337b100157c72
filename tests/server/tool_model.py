"""A tiny Llama trained (seconds, on CPU) to answer every turn with one Hermes-style tool call.

Random weights never write a tool call, so the live tool-calling tests use this model: the
same tiny architecture, its weights fitted to the conversations of a tool loop (a system
prompt with the tools, a user task, then call / tool result turns), so greedy decoding
writes ``CALL`` after each of them. The chat template is a Hermes-style one written for
these tests (tools in the system prompt, ``<tool_call>`` blocks, ``<tool_response>`` turns).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_checkpoints import CORPUS, make_tokenizer, tiny_llama_config
from transformers import AddedToken, AutoModelForCausalLM

HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools you may call:\\n<tools>\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nCall one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{- c.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role != 'system' or loop.index0 > 0 %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the cache docs.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}]
ARGUMENTS = {"query": "cache"}
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "cache"}}\n</tool_call>'
SYSTEM = "You are a helpful agent."
TASK = "How does prefix caching work?"
STEPS = 6


def loop_messages(step: int) -> list[dict]:
    """The conversation before the model's ``step``-th call (step 0: just the task)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for k in range(step):
        cid = f"call_{k}"
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "search", "arguments": ARGUMENTS}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": tool_result(k)})
    return msgs


def tool_result(k: int) -> str:
    return f"result {k}: the cache reuses pages"


def _render(tok, step: int) -> str:
    return tok.apply_chat_template(loop_messages(step), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)


def make_tool_caller(path: Path, steps: int = 200) -> Path:
    """Train and save the model; a tokenizer fitted to these conversations keeps them short."""
    tok = make_tokenizer()
    tok.chat_template = HERMES_TOOLS_TEMPLATE
    texts = [_render(tok, s) + CALL for s in range(STEPS)]
    tok = make_tokenizer(768, CORPUS + texts)
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tok.chat_template = HERMES_TOOLS_TEMPLATE
    cfg = tiny_llama_config(vocab_size=len(tok))
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    cfg.bos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    target = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    rows = []
    for step in range(STEPS):
        rows.append((tok.encode(_render(tok, step), add_special_tokens=False), target))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(rows):
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-2:
            break
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return Path(path)
