"""A request's prompt token ids and chained page hashes, computed as the workers do.

The router reads the request with the server's own parser (so bad input gets the same 400),
renders chat messages with the workers' chat template (``deepinfer.chat``) and hashes pages
with ``kv.hashing`` under the model identity a worker reports in its snapshot: equal hashes
here and in a worker's tree mean equal token prefixes.

It renders the whole conversation each turn; a worker extends the ids it generated instead
(``server/prompts.py``), so where a reply's text does not tokenise back to the same ids the
router's prediction stops there (``/metrics`` shows predicted vs reported hits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field

from ..chat import encode_text, render_text
from ..config import EngineConfig
from ..kv.hashing import chain_hashes, root_hash
from ..server.api_error import APIError
from ..server.protocol import ParsedRequest


DEFAULT_PAGE_SIZE = EngineConfig.page_size


@dataclass
class RoutedPrompt:
    parsed: ParsedRequest
    token_ids: list[int]
    _hashes: dict[tuple[str, int], list[bytes]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def page_hashes(self, model_identity: str, page_size: int) -> list[bytes]:
        """Hashes of the pages a worker's lookup may hit (one token is always computed)."""
        key = (model_identity, page_size)
        if key not in self._hashes:
            n = (self.num_tokens - 1) // page_size * page_size
            root = root_hash(model_identity, self.parsed.cache_salt)
            self._hashes[key] = chain_hashes(self.token_ids[:n], page_size, root)
        return self._hashes[key]

    def prompt_pages(self, page_size: int | None) -> int:
        """Pages of the prompt alone (``None``: deepinfer's default page size)."""
        ps = page_size or DEFAULT_PAGE_SIZE
        return -(-self.num_tokens // ps)

    def pages(self, page_size: int | None) -> int:
        """Pages the request occupies on a worker at most: prompt + max_tokens (``None``: the
        worker's page size is not known yet; deepinfer's default is assumed)."""
        ps = page_size or DEFAULT_PAGE_SIZE
        return -(-(self.num_tokens + self.parsed.params.max_tokens) // ps)


class PromptTokenizer:
    """Tokenizes on one thread of its own (a tokenizer is not shared across threads)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="router-tok")

    def _ids(self, p: ParsedRequest) -> list[int]:
        if p.kind == "chat":
            try:
                return encode_text(self.tokenizer, render_text(self.tokenizer, p.messages,
                                                               tools=p.tools.tools))
            except Exception as e:  # template errors (e.g. a role the template rejects)
                raise APIError(400, f"messages: the chat template failed: {e}",
                               param="messages") from None
        if isinstance(p.prompt, str):
            return encode_text(self.tokenizer, p.prompt)
        return list(p.prompt)

    async def prompt(self, p: ParsedRequest) -> RoutedPrompt:
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, self._ids, p)
        return RoutedPrompt(p, ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
