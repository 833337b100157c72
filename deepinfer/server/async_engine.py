"""The server's requests on the engine thread (``engine_thread.py``): admission, abort, and
what each step publishes — a request's new tokens and text, as a delta into its
``asyncio.Queue``.

Back-pressure: at most ``max_num_seqs`` requests run; up to ``max_queue`` more wait. A request
beyond that raises ``QueueFull`` (answered 429 with ``Retry-After``).

Failures: a request the engine fails alone (finish reason ``error``) gets an error delta and
the others go on; a step that fails as a whole is ``EngineThread``'s to handle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging

from ..engine import LLMEngine
from ..errors import RequestError
from ..kv.radix import DEVICE
from ..request import Request
from .api_error import APIError
from .cache_explain import CacheExplainer
from .cache_control import PinTable, breakpoint_positions
from .config import ServerConfig
from .detokenize import TextStream
from .engine_thread import EngineThread
from .live import Live, account, group_end, token_logprobs
from .metrics import ServerMetrics
from .outputs import Admitted, Delta, QueueFull, Submission, Usage
from .prompts import BuiltPrompt
from .shared_replies import SharedReplies
from .protocol import ParsedRequest
from .replies import ReplyFormat

log = logging.getLogger("deepinfer.server")


class AsyncEngine(EngineThread):
    """The engine thread serving the HTTP side's requests, each streamed to its own queue."""

    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None) -> None:
        super().__init__(engine)
        self.config = config or ServerConfig()
        self.tokenizer = engine.tokenizer
        remote = engine.tiers.remote if engine.tiers is not None else None
        self.replies = ReplyFormat(engine, self.config)  # the recipe or template + tool parser
        self.builder = self.replies.builder(engine.eos_token_ids, self.config.reply_cache_tokens,
                                            SharedReplies(remote) if remote is not None else None)
        self.metrics = ServerMetrics()
        self.pins = PinTable(engine.kv.tree, engine.kv.page_size,
                             engine.runner.pool.allocator.num_pages // 2)
        self.capacity = engine.config.max_num_seqs + self.config.max_queue
        self._live: dict[str, Live] = {}
        self._roots: dict[str, Live] = {}  # requests with several samples, until all are done
        self.explainer = CacheExplainer(engine, self.config.recent_pages,
                                        self.config.explain_cross_tenant)

    # ================================================================== event-loop side
    async def submit(self, sub: Submission) -> tuple[Admitted, asyncio.Queue]:
        """Queue a request on the engine; raises APIError (400/429/503) if it is refused."""
        q: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(lambda: self._add(sub, q, fut))
        try:
            admitted = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(sub.request_id)
            raise
        return admitted, q

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone); its pages go back. Safe from any thread."""
        if self.alive:
            self._cmds.put(lambda: self._abort(request_id))

    def _post(self, live: Live, delta: Delta) -> None:
        self._outbox.append((live.queue, delta))

    # ------------------------------------------------------------------ commands
    def build_prompt(self, p: ParsedRequest) -> BuiltPrompt:
        if p.kind == "chat":
            try:
                return self.replies.prompt(self.builder, p)
            except (RequestError, APIError):
                raise
            except Exception as e:  # template errors (e.g. a role the template rejects)
                raise APIError(400, f"messages: the chat template failed: {e}",
                               param="messages") from None
        return self.builder.completion(p.prompt)

    def _add(self, sub: Submission, q: asyncio.Queue, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the client left before we got to it
        eng, p = self.engine, sub.parsed
        try:
            if not self._accepting:
                raise APIError(503, "the server is shutting down", type="server_error",
                               code="shutting_down")
            if len(eng.requests) >= self.capacity:
                self.metrics.rejected_queue_full += 1
                raise QueueFull(self.config.retry_after_s, self.capacity)
            built = sub.prompt or self.build_prompt(p)
            params = p.params
            if p.kind == "chat" and not params.prefill_only:  # tool calls, response_format
                params = dataclasses.replace(params, structured_output=self.replies.constraint(
                    p, self.tokenizer.get_added_vocab()))  # p keeps the request's own format
            if p.max_tokens is None:  # the rest of the context
                params.max_tokens = max(1, eng.max_model_len - len(built.token_ids))
            req = eng.add_request(built.token_ids, params, sub.request_id, p.cache_salt)
            marks = breakpoint_positions(self.tokenizer, p.messages, p.tools.tools,
                                         p.cache_breakpoints) if p.cache_breakpoints else []
        except RequestError as e:
            fut.set_exception(APIError.from_request_error(
                e, {"prompt": p.prompt_field, "max_tokens": p.max_tokens_field,
                    "structured_output": p.structured_field}))
            return
        except APIError as e:
            fut.set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the thread
            log.exception("add_request failed")
            fut.set_exception(APIError(500, f"internal error: {e}", type="server_error"))
            return
        self.explainer.note_salt(p.cache_salt)
        m = self.metrics
        m.prompt_encodings[built.encoding] = m.prompt_encodings.get(built.encoding, 0) + 1
        m.history_rewrites += built.history_rewritten
        self._live[sub.request_id] = Live(sub, req, q, TextStream(
            self.tokenizer, built.token_ids, params.stop), built, breakpoints=marks)
        if params.num_samples > 1:
            self._roots[sub.request_id] = self._live[sub.request_id]
        fut.set_result(Admitted(sub.request_id, built, len(built.token_ids)))

    def _abort(self, request_id: str) -> None:
        """Abort a request: every sample of it still running (the first may have ended)."""
        root = self._roots.pop(request_id, None)
        group = root.req.group if root is not None else None
        lives = [self._live.pop(m.request_id, None) for m in group.members] if group else \
            [self._live.pop(request_id, None)]
        lives = [lv for lv in lives if lv is not None]
        if not lives:
            return
        computed = [lv.req.num_computed_tokens for lv in lives]  # before abort() releases them
        self.engine.abort(request_id)  # every sample of it
        self.metrics.aborted += 1
        for lv, n in zip(lives, computed):
            self._account(lv, "abort", n)

    def _fail_all(self, message: str) -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be in a bad state already
                log.exception("abort after engine error failed")
            self._post(live, Delta(error=message))
        self._live.clear()
        self._roots.clear()

    # ------------------------------------------------------------------ stepping
    def _step(self) -> None:
        self.pins.expire()
        sampled = self._engine_step()
        if sampled is None:
            self.metrics.engine_errors += 1
            return
        for req in sampled:
            live = self._live.get(req.request_id)
            if live is None and req.group is not None and req.group.request_id in self._roots:
                live = self._adopt(self._roots[req.group.request_id], req)
            if live is not None:
                self._publish(live, req)

    def _adopt(self, root: Live, req: Request) -> Live:
        """The stream of a sample forked from ``root``'s request (same client queue)."""
        live = Live(root.sub, req, root.queue, TextStream(
            self.tokenizer, root.prompt.token_ids, req.params.stop), root.prompt,
            index=req.sample_index)
        self._live[req.request_id] = live
        return live

    def _publish(self, live: Live, req: Request) -> None:
        if req.finish_reason == "error":  # failed alone inside the engine
            del self._live[req.request_id]
            self.metrics.request_errors += 1
            self._account(live, "error", req.num_computed_tokens)
            if req.group is not None:  # one sample failed: so does the request it belongs to
                self._roots.pop(req.group.request_id, None)
                for m in req.group.members:
                    self._live.pop(m.request_id, None)
                self.engine.abort(req.group.request_id)
            self._post(live, Delta(error=f"engine error: {req.error}", index=live.index))
            return
        start, end = live.num_sent_ids, len(req.output_token_ids)
        new = req.output_token_ids[start:end]
        live.num_sent_ids = end
        lps = token_logprobs(self.tokenizer, req, start, end) if live.sub.parsed.want_logprobs else None
        ranked = req.params.best_of is not None  # samples are sent once the best are known
        if not req.is_finished:
            text = live.stream.push(new)
            if (text or lps or new) and not ranked:  # ids too: DeepSeek parses ids
                self._post(live, Delta(text, new, lps, index=live.index))
            return
        # The final text is authoritative (cut before a stop string): send what is missing.
        out = self.engine.make_output(req)
        text = live.stream.finish(out.text)
        del self._live[req.request_id]
        usage = self._account(live, req.finish_reason, len(req.prompt_token_ids) + end - 1)
        p = live.sub.parsed
        for pos, mark in zip(live.breakpoints, p.cache_breakpoints):
            self.pins.pin(req.page_hashes, pos, mark.ttl_s)
        tools = self.replies.final(p, req.request_id, out.text, list(req.output_token_ids))
        if p.kind == "chat" and live.prompt.key_state is not None and req.output_token_ids:
            message = {"role": "assistant", "content": tools.content if tools else out.text}
            if tools and tools.reasoning is not None:
                message["reasoning_content"] = tools.reasoning
            if tools and tools.calls:
                message["tool_calls"] = [c.to_message() for c in tools.calls]
            self.builder.remember(live.prompt.key_state, req.prompt_token_ids,
                                  list(req.output_token_ids), message)
        finish = "tool_calls" if tools and tools.calls else req.finish_reason
        stop = req.stop_reason if isinstance(req.stop_reason, str) else None
        final = Delta(text, new, lps, finish, usage if req.group is None else None,
                      index=live.index, tool_output=tools, stop_string=stop)
        if req.group is None:
            self._post(live, final)
            return
        root = self._roots[req.group.request_id]
        root.samples_done += 1
        if root.samples_done < len(req.group.members):
            if not ranked:
                self._post(live, final)
            return
        del self._roots[req.group.request_id]
        for d in group_end(root, req.group, final, ranked, self.tokenizer,
                             self.engine.output_text):
            self._post(root, d)

    def _account(self, live: Live, reason: str, computed_tokens: int) -> Usage:
        usage = account(live, reason, self.metrics, self.engine.kv.page_size)
        self.explainer.remember_pages(live.req, computed_tokens)
        return usage

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> tuple[dict, ServerMetrics]:
        """(engine stats, server counters); run on the engine thread via ``call``."""
        return self.engine.stats(), self.metrics.copy()

    def kv_snapshot(self) -> dict:
        """Page accounting, to check that ended requests gave their pages back."""
        kv = self.engine.kv
        cached = kv.tree.evictable_pages(DEVICE) if kv.tree is not None else 0
        return {"free_pages": kv.num_free_pages, "evictable_cached_pages": cached,
                "total_pages": self.engine.runner.pool.allocator.num_pages,
                "live_requests": len(self._live), "engine_requests": len(self.engine.requests)}

    def explain(self, p: ParsedRequest) -> dict:
        """Body of POST /v1/cache/explain; run on the engine thread via ``call``."""
        try:
            return self.explainer.explain(self.build_prompt(p), p.cache_salt)
        except RequestError as e:
            raise APIError.from_request_error(e, {"prompt": p.prompt_field}) from None
