"""Why a prompt does (not) hit the prefix cache: a read-only walk of the radix tree.

``explain_prefix`` answers, for a token sequence and a cache salt, which leading pages are
cached and in which tier, how many tokens a request would get from the cache, and where and
why matching stops. Unlike ``RadixTree.match`` it never splits nodes, touches LRU clocks or
counts hits, so asking does not change the answer (or the eviction order).

Why matching stops, in the order they are checked:

* ``prefix_cache_disabled``: the engine runs without a prefix cache.
* ``partial_page``: every whole page hit; the tail is shorter than a page, and only whole
  pages are cached.
* ``last_token``: every page hit, but at least one prompt token is always computed (its
  logits start the generation), so the last page is recomputed.
* ``evicted``: the next page was cached by a recent request (the caller keeps a bounded
  record of such page hashes) but is no longer in any tier.
* ``salt``: the same tokens are cached under another cache salt (salts never share entries).
  Which salt is not reported; only the salts the caller passes are probed.
* ``diverged``: the cache holds a continuation that shares tokens with the prompt but
  differs at ``diverge_at`` (``cached_tokens`` is that continuation from the page start).
  Only continuations of the request's own salt count: another tenant's tokens never show.
* ``not_cached``: nothing cached continues the prompt here.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .hashing import chain_hashes, root_hash
from .radix import TIER_NAMES, Node, common_len

if TYPE_CHECKING:
    from .cache_manager import KVCacheManager


@dataclass
class Span:
    start: int  # token index, inclusive
    end: int  # token index, exclusive
    tier: str  # where the pages live: "device", "host", "disk"


@dataclass
class PrefixExplanation:
    num_tokens: int
    page_size: int
    spans: list[Span] = field(default_factory=list)
    matched_tokens: int = 0  # whole pages found in the tree, in any tier
    hit_tokens: int = 0  # of which a request would take from the cache (one token always computed)
    reason: str = "not_cached"
    position: int = 0  # first token a request would compute
    diverge_at: int | None = None  # "diverged": first token that differs from the cache
    cached_tokens: list[int] | None = None  # "diverged": the cache's tokens from the stop page on
    other_salt_tokens: int = 0  # "salt": tokens cached under another salt from the start
    detail: str = ""

    @property
    def hit_tokens_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.spans:
            n = max(0, min(s.end, self.hit_tokens) - s.start)
            if n:
                out[s.tier] = out.get(s.tier, 0) + n
        return out


def _walk(tree, hashes: list[bytes]) -> tuple[list[tuple[Node, int]], Node, int]:
    """Match ``hashes`` against the tree without changing it.

    Returns the matched (node, pages used) path, the node where matching stopped, and how
    many pages of that node matched (0 when it stopped at a node boundary: the stop node is
    then the parent whose children did not continue).
    """
    path: list[tuple[Node, int]] = []
    node, i = tree.root, 0
    while i < len(hashes):
        child = node.children.get(hashes[i])
        if child is None:
            return path, node, 0
        n = 0
        while n < child.num_pages and i + n < len(hashes) and child.hashes[n] == hashes[i + n]:
            n += 1
        path.append((child, n))
        i += n
        if n < child.num_pages:
            return path, child, n
        node = child
    return path, node, 0


def explain_prefix(kv: KVCacheManager, tokens: list[int], salt: str | None = None,
                   other_salts: Iterable[str | None] = (),
                   recently_cached: Container[bytes] | None = None,
                   context: int = 16) -> PrefixExplanation:
    """Explain the prefix-cache lookup of ``tokens`` under ``salt`` in ``kv`` (a KVCacheManager).

    ``other_salts`` are salts to probe for the ``salt`` reason; ``recently_cached`` holds
    page hashes recently cached (for the ``evicted`` reason); ``context`` is how many cached
    tokens past the divergence ``cached_tokens`` keeps.
    """
    ps = kv.page_size
    n_tok = len(tokens)
    out = PrefixExplanation(num_tokens=n_tok, page_size=ps)
    tree = kv.tree
    if tree is None:
        out.reason = "prefix_cache_disabled"
        out.detail = "the engine runs without a prefix cache (--no-prefix-cache)"
        return out
    root = root_hash(kv.model_identity, salt)
    hashes = chain_hashes(tokens, ps, root)
    path, stop_node, stop_off = _walk(tree, hashes)
    pos = 0
    for node, n in path:
        tier = node.best_tier()
        name = TIER_NAMES[tier] if tier is not None else "none"
        end = pos + n * ps
        if out.spans and out.spans[-1].tier == name:
            out.spans[-1].end = end
        else:
            out.spans.append(Span(pos, end, name))
        pos = end
    matched_pages = pos // ps
    out.matched_tokens = pos
    cap = (n_tok - 1) // ps if n_tok else 0  # the engine leaves at least one token to compute
    out.hit_tokens = min(matched_pages, cap) * ps
    out.position = out.hit_tokens

    if matched_pages == len(hashes):  # every whole page hit
        if n_tok % ps and n_tok >= ps:
            out.reason = "partial_page"
            out.detail = (f"all {len(hashes)} whole pages hit; the last {n_tok % ps} tokens do not "
                          f"fill a page of {ps} and only whole pages are cached")
        elif n_tok < ps:
            out.reason = "partial_page"
            out.detail = f"the prompt ({n_tok} tokens) is shorter than one page of {ps} tokens"
        else:
            out.reason = "last_token"
            out.detail = ("every page hit, but one prompt token is always computed (its logits "
                          "start the generation), so the last page is recomputed")
        return out

    page_start = matched_pages * ps
    nxt = hashes[matched_pages]
    if recently_cached is not None and nxt in recently_cached:
        out.reason = "evicted"
        out.detail = (f"the page at tokens {page_start}..{page_start + ps} was cached by a recent "
                      f"request and has since been evicted from every tier")
        return out

    for other in other_salts:
        if other == salt or (other or "") == (salt or ""):
            continue
        ohashes = chain_hashes(tokens, ps, root_hash(kv.model_identity, other))
        opath, _, _ = _walk(tree, ohashes)
        opages = sum(n for _, n in opath)
        if opages > matched_pages:
            out.reason = "salt"
            out.other_salt_tokens = opages * ps
            out.detail = (f"tokens 0..{opages * ps} are cached under a different cache_salt; "
                          f"entries are never shared across salts")
            return out

    # Candidate continuations: the rest of a partly matched node, or the stop node's children.
    if stop_off:
        cands = [stop_node.tokens[stop_off * ps:] if stop_node.tokens is not None else None]
    elif stop_node is tree.root:  # the root's children start every salt's chain: only ours
        cands = [c.tokens for c in stop_node.children.values() if c.tokens is not None
                 and chain_hashes(c.tokens[:ps], ps, root) == c.hashes[:1]]
    else:  # below the root every node continues this salt's own chain
        cands = [c.tokens for c in stop_node.children.values()]
    rest = tokens[page_start:]
    best, best_len = None, 0
    for c in cands:
        if c is None:
            continue
        k = common_len(rest, c)
        if k > best_len:
            best, best_len = c, k
    if best is not None:
        out.reason = "diverged"
        out.diverge_at = page_start + best_len
        out.cached_tokens = list(best[: best_len + context])
        out.detail = (f"the cache continues the prompt from token {page_start} but differs at "
                      f"token {out.diverge_at}; the page holding it is recomputed")
        return out
    out.reason = "not_cached"
    out.detail = (f"no cached continuation after token {page_start}" if page_start
                  else "no cached entry starts like this prompt")
    return out
