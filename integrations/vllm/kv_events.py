"""The connector's KV events: vLLM `BlockStored` for the chunks this engine stored in the
sidecar, once the sidecar acknowledged them, for `take_events` (vLLM's publisher sends them).

A chunk's events carry vLLM's own block hashes of its blocks (read from the request, as its
block pool reads them) and `medium` "kvsplice"; its save carries the same hashes to the
sidecar (`SaveSpec.block_hashes`), which publishes them too (`kvsplice serve --kv-events-endpoint`). Only
exact chunks: an off-chain chunk's K/V is not what those hashes name. Removals are the
sidecar's to tell (it knows what leaves). Knows vLLM's request, not the ledger's rounds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvsplice.common.engine_blocks import KV_EVENTS_MEDIUM
from kvsplice.integrations.vllm.transfer_specs import SaveSpec

# Saves in flight whose event waits (an unanswered one is dropped past this many).
MAX_PENDING = 65_536
Key = tuple[str, bytes]  # (namespace, a chunk's context key)


class StoredEvents:
    def __init__(self, block_size: int, hash_block_size: int) -> None:
        self.block_size, self.hash_block_size = block_size, hash_block_size
        self._pending: OrderedDict[Key, BlockStored] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def with_hashes(self, request: Any, specs: Sequence[SaveSpec]) -> list[SaveSpec]:
        """`specs`, the exact ones carrying vLLM's block hashes of their blocks; their
        events wait for the sidecar's acknowledgement."""
        return [self._hashed(request, spec) if spec.exact else spec for spec in specs]

    def acknowledged(self, keys: Collection[Key]) -> None:
        for key in keys:
            event = self._pending.pop(key, None)
            if event is not None:
                self._ready.append(event)

    def failed(self, keys: Collection[Key]) -> None:
        for key in keys:
            self._pending.pop(key, None)

    def take(self) -> list[KVCacheEvent]:
        """The events of chunks acknowledged since the last call."""
        ready, self._ready = self._ready, []
        return ready

    def _hashed(self, request: Any, spec: SaveSpec) -> SaveSpec:
        raw = getattr(request, "block_hashes", None)  # None: vLLM hashes nothing of it
        if not raw:
            return spec
        hashes = resolve_block_hashes(raw, self.hash_block_size, self.block_size)
        first, end = spec.start // self.block_size, spec.end // self.block_size
        if end > len(hashes):
            return spec  # not hashed yet (vLLM hashes whole blocks as they fill)
        own = tuple(bytes(hashes[i]) for i in range(first, end))
        parent = bytes(hashes[first - 1]) if first else b""
        spec = replace(spec, block_hashes=own, parent_block_hash=parent)
        self._pending[(spec.namespace, spec.key)] = self._event(request, spec)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        return spec

    def _event(self, request: Any, spec: SaveSpec) -> BlockStored:
        """The event vLLM's block pool would publish for these blocks, in `medium` kvsplice."""
        lora = getattr(request, "lora_request", None)
        extra_keys = [
            generate_block_hash_extra_keys(request, start, start + self.block_size, 0)[0]
            for start in range(spec.start, spec.end, self.block_size)
        ]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in spec.block_hashes],
            parent_block_hash=(
                maybe_convert_block_hash(spec.parent_block_hash) if spec.parent_block_hash else None
            ),
            token_ids=list(spec.token_ids),
            block_size=self.block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=KV_EVENTS_MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=0,  # the connector serves one KV cache group (connector._checked_layout)
            session_id=getattr(request, "session_id", None),
        )
