"""What the sidecar's KV event stream has said: the engine blocks the index holds, the
batches published, and what a late subscriber is replayed.

A segment carrying its engine's block hashes (`common.engine_blocks`) is announced when
indexed and withdrawn when unindexed; a block two segments hold (a chunk and its half-chunk
tail, one text in two namespaces) is removed only when the last of them goes. Not thread-safe:
the publisher's thread owns it. Knows segment metas and the wire's events, not sockets.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from enum import Enum

from kvsplice.common.segment import SegmentMeta
from kvsplice.server.kv_event_wire import (
    AllBlocksCleared,
    KvEvent,
    block_removed,
    block_stored,
    encode_batch,
)

Key = tuple[str, bytes]  # (namespace, context key)


class Cleared(Enum):
    """The index starts empty (a sidecar start): subscribers drop what they held."""

    CLEARED = "cleared"


# A segment indexed (its meta), one unindexed (its key), or the index emptied.
Change = SegmentMeta | Key | Cleared


class KvEventLog:
    def __init__(self, hash_format: str, buffer_steps: int) -> None:
        self._hash_format = hash_format
        self._held: dict[Key, SegmentMeta] = {}  # segments with engine blocks, indexed
        self._holders: Counter[bytes] = Counter()  # block hash -> segments holding it
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.last_seq = -1

    def events(self, changes: Iterable[Change]) -> list[KvEvent]:
        """The events `changes` (in index order) make due; the held blocks follow them."""
        events: list[KvEvent] = []
        for change in changes:
            if isinstance(change, Cleared):
                self._held.clear()
                self._holders.clear()
                events.append(AllBlocksCleared())
            elif isinstance(change, SegmentMeta):
                events += self._indexed(change)
            else:
                events += self._unindexed(change)
        return events

    def published(self, payload: bytes) -> int:
        """Record a batch sent; its sequence number."""
        self.last_seq += 1
        self._buffer.append((self.last_seq, payload))
        return self.last_seq

    def replay(self, start_seq: int, ts: float) -> list[tuple[int, bytes]]:
        """The batches from `start_seq` on; where the buffer no longer reaches back that far,
        one batch instead, tagged with the last sequence number: `AllBlocksCleared`, then a
        `BlockStored` per held segment (what the index holds now)."""
        oldest = self._buffer[0][0] if self._buffer else self.last_seq + 1
        if start_seq >= oldest:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        events: list[KvEvent] = [AllBlocksCleared()]
        events += [self._stored(meta) for meta in self._held.values()]
        return [(max(self.last_seq, 0), encode_batch(ts, events))]

    def held_hashes(self) -> set[bytes]:
        return set(self._holders)

    def _indexed(self, meta: SegmentMeta) -> list[KvEvent]:
        if not meta.engine_block_hashes:
            return []  # not an engine's blocks (an HF client's span, an anchor): no event
        key = (meta.namespace, meta.context_key)
        previous = self._held.get(key)
        if previous is not None and previous.engine_block_hashes == meta.engine_block_hashes:
            return []  # indexed again (a put of the same segment): said already
        events = self._unindexed(key) if previous is not None else []
        self._held[key] = meta
        self._holders.update(meta.engine_block_hashes)
        return [*events, self._stored(meta)]

    def _unindexed(self, key: Key) -> list[KvEvent]:
        meta = self._held.pop(key, None)
        if meta is None:
            return []
        self._holders.subtract(meta.engine_block_hashes)
        gone = [h for h in dict.fromkeys(meta.engine_block_hashes) if self._holders[h] <= 0]
        for block_hash in gone:
            del self._holders[block_hash]
        return [block_removed(gone, self._hash_format)] if gone else []

    def _stored(self, meta: SegmentMeta) -> KvEvent:
        return block_stored(
            meta.engine_block_hashes, meta.engine_parent_block_hash, meta.token_ids,
            self._hash_format,
        )  # fmt: skip
