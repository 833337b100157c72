"""Structured-output cost, two ways (run: ``python benchmarks/structured.py``; ``--quick``:
fewer rounds and tokens, about two minutes).

1. ``libs``: per-token cost of mask + advance of each grammar library that is installed
   (llguidance, xgrammar, outlines-core), teacher-forced over one JSON document with the
   SmolLM2 tokenizer, rounds interleaved so a busy machine hurts all alike.
2. ``engine``: decode tokens/s of the engine on SmolLM2 with every request constrained by a
   JSON schema vs none, interleaved rounds, and the mask overhead per token that implies.

Prints the CPU model with the results (figures are only comparable on the same machine).
xgrammar and outlines-core are not dependencies: ``pip install xgrammar outlines-core`` to
compare them too (a library that is not installed is skipped and said so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
import torch

from deepinfer.hardware import lscpu_model
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "kind", "ok"], "additionalProperties": False}
DOC = {"name": "Alice in Wonderland", "age": 42, "tags": ["a", "bb", "hello world"],
       "kind": "dog", "ok": True}
# a story long enough that every request decodes max_tokens on both sides (equal batches)
STORY = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                          "story": {"type": "string", "minLength": 4000}},
         "required": ["title", "story"], "additionalProperties": False}


# ---------------------------------------------------------------------- libraries
def lib_runners(tok, vocab: int, eos: int, ids: list[int]) -> dict:
    """name -> (compile seconds, a function running one teacher-forced pass: per-token s)."""
    runners = {}
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        llt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False})
        llguidance.LLMatcher(llt, g)
        compile_s = time.perf_counter() - t0

        def run_llg() -> list[float]:
            m, bm, out = llguidance.LLMatcher(llt, g), lt.allocate_token_bitmask(1, vocab), []
            for t in ids:
                s = time.perf_counter()
                lt.fill_next_token_bitmask(m, bm, 0)
                assert m.consume_token(t), m.get_error()
                out.append(time.perf_counter() - s)
            return out
        runners["llguidance"] = (compile_s, run_llg)
    except ImportError:
        print("llguidance: not installed")
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
        comp = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                      separators=(",", ":"))
        compile_s = time.perf_counter() - t0

        def run_xgr() -> list[float]:
            m, bm, out = xgr.GrammarMatcher(cg), xgr.allocate_token_bitmask(1, vocab), []
            for t in ids:
                s = time.perf_counter()
                m.fill_next_token_bitmask(bm, 0)
                assert m.accept_token(t)
                out.append(time.perf_counter() - s)
            return out
        runners["xgrammar"] = (compile_s, run_xgr)
    except ImportError:
        print("xgrammar: not installed")
    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        vmap: dict[str, list[int]] = {}
        for i in range(len(tok)):
            if i != eos:
                text = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(i)])
                if text:
                    vmap.setdefault(text, []).append(i)
        vocab_oc = oc.Vocabulary(eos, vmap)
        t0 = time.perf_counter()
        index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocab_oc)
        compile_s = time.perf_counter() - t0

        def run_oc() -> list[float]:
            guide, bm, out = oc.Guide(index), torch.zeros(-(-vocab // 32), dtype=torch.int32), []
            for t in ids[:-1]:  # the guide has no step for the stop token
                s = time.perf_counter()
                guide.write_mask_into(bm.data_ptr(), bm.numel(), 4)
                guide.advance(t)
                out.append(time.perf_counter() - s)
            return out
        runners["outlines-core"] = (compile_s, run_oc)
    except ImportError:
        print("outlines-core: not installed")
    return runners


def bench_libs(llm: LLM, rounds: int) -> None:
    tok, eng = llm.tokenizer, llm.engine
    eos = sorted(eng.eos_token_ids)[0]
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False) + [eos]
    runners = lib_runners(tok, eng.hf_config.vocab_size, eos, ids)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, (_, fn) in runners.items():
            times[name] += fn()
    print(f"\n## grammar libraries: mask + advance per token ({len(ids)} tokens x {rounds} "
          "rounds, interleaved)")
    print("| library | compile ms | median us | mean us | p90 us |")
    print("|---|---|---|---|---|")
    for name, v in times.items():
        v = sorted(v)
        print(f"| {name} | {runners[name][0] * 1e3:.1f} | {statistics.median(v) * 1e6:.1f} | "
              f"{statistics.mean(v) * 1e6:.1f} | {v[int(0.9 * len(v))] * 1e6:.1f} |")


# ---------------------------------------------------------------------- engine
def decode_rate(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    """Decode tokens/s after every request has its first token, and tokens decoded."""
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in prompts]
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    start_tokens = sum(len(r.output_token_ids) for r in reqs)
    t0 = time.perf_counter()
    while any(not r.is_finished for r in reqs):
        eng.step()
    dt = time.perf_counter() - t0
    n = sum(len(r.output_token_ids) for r in reqs) - start_tokens
    return n / dt, n


def bench_engine(llm: LLM, batch: int, max_tokens: int, rounds: int) -> None:
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write story number {i} about a fox, as JSON with a "
                                     "title and a long story."}],
        tokenize=False, add_generation_prompt=True) for i in range(batch)]
    free = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0,
                                 structured_output=StructuredOutput.json_schema(STORY))
    decode_rate(llm, prompts[:1], constrained)  # warm-up: compiles the grammar once
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    tokens = {"unconstrained": 0, "json_schema": 0}
    for _ in range(rounds):
        for name, p in (("unconstrained", free), ("json_schema", constrained)):
            r, n = decode_rate(llm, prompts, p)
            rates[name].append(r)
            tokens[name] += n
    print(f"\n## engine decode on SmolLM2-135M, batch {batch}, up to {max_tokens} tokens, "
          f"{rounds} interleaved rounds (best round)")
    print("| requests | decode tok/s | tokens decoded |")
    print("|---|---|---|")
    for name in rates:
        print(f"| {name} | {max(rates[name]):.1f} | {tokens[name]} |")
    u, c = max(rates["unconstrained"]), max(rates["json_schema"])
    per_token_us = (1 / c - 1 / u) * 1e6  # extra step time per constrained sequence
    print(f"\nmask overhead: {100 * (u / c - 1):.1f}% slower decode, "
          f"{per_token_us:.0f} us per constrained token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["libs", "engine", "all"], default="all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true",
                    help="2 rounds, batch 4, 32 tokens: a check that it runs, rough figures")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.batch, a.max_tokens = 2, 4, 32
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"CPU: {lscpu_model()}; torch threads: {torch.get_num_threads()}")
    llm = LLM(None, progress=False, enable_disk_cache=False)
    if a.part in ("libs", "all"):
        bench_libs(llm, a.rounds)
    if a.part in ("engine", "all"):
        bench_engine(llm, a.batch, a.max_tokens, a.rounds)


if __name__ == "__main__":
    main()
