"""What the DeepSeek-V4 and V4.1 prefix-reuse tests share: the tiny checkpoint folder, and the
engine checks both compressed-attention models must pass (logits after a hit equal the no-cache
ones; a restarted engine hits the disk pages and snapshots)."""

from pathlib import Path

from test_window_reuse import GREEDY, check_accounting, ids, logits_after_a_hit, make
from tiny_checkpoints import make_tokenizer


def save_tiny(path: Path, build) -> Path:
    """``build(vocab_size)``: the model, saved with the chat tokenizer's eos / bos ids."""
    tok = make_tokenizer()
    model = build(len(tok))
    model.config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.bos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def check_logits_after_a_hit(path: Path, **kw) -> None:
    """A hit of 40 tokens (cached + replayed), then logits within 1e-5 of no cache."""
    shared = ids(43, 5)
    logits, ref, start = logits_after_a_hit(path, shared + ids(13, 6), shared + ids(9, 7), **kw)
    assert start == 40
    assert (logits - ref).abs().max().item() <= 1e-5


def restart_hits_disk(path: Path, tmp_path: Path):
    """A restarted engine sharing the disk directory hits 40 tokens from L3 (the snapshot at 40,
    a gap of 4 replayed) and decodes the no-cache tokens; returns it, still running."""
    shared = ids(46, 15)  # the hit: 44 tokens; interval snapshots every 8
    p1, p2 = shared + ids(7, 16), shared + ids(9, 17)
    ref = make(path, enable_prefix_cache=False).generate(p2, GREEDY)[0].token_ids

    def restarted():
        return make(path, enable_disk_cache=True, disk_cache_dir=str(tmp_path))

    first = restarted()
    first.generate(p1, GREEDY)
    assert first.engine.shutdown()
    second = restarted()
    o = second.generate(p2, GREEDY)[0]
    check_accounting(o)
    assert o.token_ids == ref
    assert (o.num_cached_tokens, o.num_replayed_tokens) == (40, 4)
    assert o.cached_tokens_by_tier["disk"] == 40
    return second
