"""Chat reply records shared through the networked store (``--kv-store``), so that every
worker behind one store builds a conversation's next turn from the same token ids.

The prefix-stable chat encoding (``prompts.py``) extends a conversation with the ids a reply
was generated as, which only the worker that generated it knows. Under prefill/decode
disaggregation (``pd.py``) the next turn is prefilled by another worker: without the record it
re-tokenises the reply's text, its pages stop matching the decode side's at the first id that
changed, and the decode worker computes the rest again. So a record (the prompt ids and reply
ids, under the reply's key) is also put in the store when a reply ends, and a worker that does
not hold a record looks there. Records are stored in the page files' format (namespace, key,
checksum or MAC), so a damaged or foreign one is ignored like a bad page; a store that is down
costs the encoding's reuse, never a wrong prompt.
"""

from __future__ import annotations

import hashlib
import struct
from array import array

from ..kv.tiers.remote_store import RemoteStore

_COUNTS = struct.Struct("<II")  # prompt ids, reply ids


class SharedReplies:
    """Reply records in one networked store (the engine's L3 remote store)."""

    def __init__(self, remote: RemoteStore) -> None:
        self.remote = remote

    def _key(self, key: bytes) -> str:
        h = hashlib.blake2b(digest_size=16, person=b"deepinfer-reply")
        h.update(self.remote.namespace.encode() + b"\n" + key)  # the model identity and codec
        return h.hexdigest()

    def put(self, key: bytes, prompt_ids: list[int], reply_ids: list[int]) -> None:
        body = array("i", prompt_ids + reply_ids).tobytes()
        self.remote.put_record(self._key(key), _COUNTS.pack(len(prompt_ids), len(reply_ids)) + body)

    def get(self, key: bytes) -> tuple[list[int], list[int]] | None:
        data = self.remote.get_record(self._key(key))
        if data is None or len(data) < _COUNTS.size:
            return None
        n_prompt, n_reply = _COUNTS.unpack_from(data)
        ids = array("i")
        ids.frombytes(data[_COUNTS.size :])
        if len(ids) != n_prompt + n_reply:
            return None
        return ids[:n_prompt].tolist(), ids[n_prompt:].tolist()
