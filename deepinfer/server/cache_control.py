"""Anthropic ``cache_control`` breakpoints: where they fall in the prompt, and pins with a TTL.

A breakpoint marks "cache the prompt up to here". Its token position is found by rendering
the request cut just after the marked block (a system block, a tool, a message block) and
measuring how much of the full rendering it shares. The server then

* reports ``cache_creation_input_tokens``: prompt tokens this request computed that lie in
  the whole pages before its last breakpoint (they are now cached);
* makes the breakpoint a cache-unit boundary and pins it: the radix tree is split at the
  breakpoint's last whole page and that node is locked for the breakpoint's TTL (5 minutes,
  or 1 hour with ``"ttl": "1h"``), so it is not evicted while a client expects it. A hit
  refreshes the TTL, as Anthropic's does. Pins hold at most half of the device pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..chat import encode_text, render_text
from ..kv.radix import DEVICE, Node

TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # as Anthropic's API


@dataclass
class CacheBreakpoint:
    """The request cut just after a marked block, and how long to keep that prefix."""

    messages: list[dict]
    tools: list[dict] | None
    ttl_s: float


def breakpoint_positions(tokenizer, messages: list[dict], tools: list[dict] | None,
                         breakpoints: list[CacheBreakpoint]) -> list[int]:
    """Token position of each breakpoint in the prompt of (``messages``, ``tools``)."""
    if not breakpoints:
        return []
    full = render_text(tokenizer, messages, tools=tools)
    out = []
    for b in breakpoints:
        cut = render_text(tokenizer, b.messages, add_generation_prompt=False, tools=b.tools)
        n = 0
        while n < min(len(cut), len(full)) and cut[n] == full[n]:
            n += 1
        out.append(len(encode_text(tokenizer, full[:n])))
    return out


def creation_tokens(positions: list[int], page_size: int, prompt_tokens: int, hit: int) -> int:
    """Prompt tokens computed by this request that are cached up to its last breakpoint."""
    if not positions:
        return 0
    cached_end = min(max(positions), prompt_tokens - 1) // page_size * page_size
    return max(0, cached_end - hit)


class PinTable:
    """Breakpoint pins: radix nodes locked until their TTL runs out (engine thread only)."""

    def __init__(self, tree, page_size: int, max_pages: int) -> None:
        self.tree = tree
        self.page_size = page_size
        self.max_pages = max_pages
        # last pinned page's hash -> (node, expiry, pages)
        self.pins: dict[bytes, tuple[Node, float, int]] = {}
        self.pinned_pages = 0
        self.refused = 0

    def pin(self, page_hashes: list[bytes], position: int, ttl_s: float,
            now: float | None = None) -> bool:
        """Pin the whole pages before token ``position`` of a request's prompt."""
        n = min(position // self.page_size, len(page_hashes))
        if self.tree is None or n == 0:
            return False
        now = time.monotonic() if now is None else now
        key = page_hashes[n - 1]
        if key in self.pins:
            node, expiry, pages = self.pins[key]
            self.pins[key] = (node, max(expiry, now + ttl_s), pages)
            return True
        if self.pinned_pages + n > self.max_pages:
            self.refused += 1
            return False
        m = self.tree.match(page_hashes[:n], touch=True, count_hit=False)  # splits at page n
        if m.num_pages < n or m.last.tiers[DEVICE] is None:
            return False  # not (all) on the device: nothing to keep there
        self.tree.lock(m.last)
        self.pins[key] = (m.last, now + ttl_s, n)
        self.pinned_pages += n
        return True

    def expire(self, now: float | None = None) -> int:
        """Unlock the pins whose TTL ran out; returns how many."""
        now = time.monotonic() if now is None else now
        done = [k for k, (_, expiry, _) in self.pins.items() if expiry <= now]
        for k in done:
            node, _, pages = self.pins.pop(k)
            self.tree.unlock(node)
            self.pinned_pages -= pages
        return len(done)
