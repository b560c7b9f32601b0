"""The connector's scheduler half: what the sidecar holds for a request, and what to save.

`num_new_matched_tokens` looks the request's tokens up (`LookupPrefix` over the
chained context keys) and promises the block-aligned stored run; repeated calls
for one request reuse the first answer, so it has no effect the scheduler can
see. `build_step` turns this step's allocations into `LoadSpec`s, and every chunk
of computed tokens the sidecar does not hold yet into a `SaveSpec`. Only exact
prefixes are ever promised: the chain keys name tokens after exactly their left
context. Knows vLLM's request and scheduler-output objects only through the
few attributes it reads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsplice.client.store.store_types import PrefixLookup
from kvsplice.common.keys import KeyChain
from kvsplice.integrations.vllm.connector_config import salted_namespace
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, RequestStart, SaveSpec, StoredPiece

logger = logging.getLogger(__name__)

# Chunk keys this engine put recently: a system prompt shared by many requests is sent once.
MAX_RECENT_KEYS = 65_536


@dataclass
class _Tracked:
    """One request from its first lookup until it finishes."""

    request: Any  # vllm.v1.request.Request
    namespace: str
    lookup: PrefixLookup
    num_lookup_tokens: int
    chain: KeyChain
    block_ids: list[int] = field(default_factory=list)
    held_keys: frozenset[bytes] = frozenset()
    pending_load: LoadSpec | None = None
    num_local_tokens: int = 0  # computed or cached in the engine when the load was promised


class SchedulerSide:
    def __init__(
        self,
        clients: StoreClients,
        fingerprint: str,
        block_size: int,
        chunk_tokens: int,
        save_decode: bool = False,
    ) -> None:
        self.clients = clients
        self.save_decode = save_decode
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self._tracked: dict[str, _Tracked] = {}
        self._recent_keys: OrderedDict[bytes, None] = OrderedDict()
        self.num_hit_tokens = 0
        self.num_lookups = 0

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` the sidecar holds, whole blocks, leaving one to compute."""
        tracked = self._track(request)
        tracked.num_local_tokens = num_computed_tokens
        limit = min(tracked.lookup.num_matched_tokens, tracked.num_lookup_tokens - 1)
        aligned = limit // self.block_size * self.block_size
        return max(0, aligned - num_computed_tokens)

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Remember where the promised tokens go; a load is built for the next step."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        start = tracked.num_local_tokens
        end = start + num_external_tokens
        first, last = start // self.block_size, end // self.block_size
        tokens = tuple(tracked.request.all_token_ids[:end])
        tracked.pending_load = LoadSpec(
            request_id=request.request_id,
            namespace=tracked.namespace,
            start=start,
            end=end,
            block_ids=tuple(block_ids[first:last]),
            token_ids=tokens,
            pieces=_pieces(tracked.lookup, self.fingerprint, start, end),
        )
        self.num_hit_tokens += num_external_tokens

    def build_step(
        self, scheduler_output: Any
    ) -> tuple[list[LoadSpec], list[SaveSpec], list[RequestStart]]:
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        starts: list[RequestStart] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            request = tracked.request
            starts.append(RequestStart(new.req_id, tracked.namespace, request.num_prompt_tokens))
            tracked.block_ids = list(new.block_ids[0])
            self._take_load(tracked, loads)
            computed = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            saves.extend(self._saves(tracked, computed, scheduler_output))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: all its blocks are new
                tracked.block_ids = [] if new_blocks is None else list(new_blocks[0])
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._take_load(tracked, loads)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            saves.extend(self._saves(tracked, computed, scheduler_output))
        return loads, saves, starts

    def finished(self, request: Any) -> None:
        self._tracked.pop(request.request_id, None)

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        token_ids = request.all_token_ids
        if tracked is not None and tracked.num_lookup_tokens == len(token_ids):
            return tracked
        namespace = salted_namespace(self.clients.config.namespace, request.cache_salt)
        lookup = self.clients.for_namespace(namespace).lookup_prefix(self.fingerprint, token_ids)
        self.num_lookups += 1
        held = frozenset(ref.context_key for ref in lookup.segments)
        tracked = _Tracked(
            request, namespace, lookup, len(token_ids), KeyChain(self.fingerprint), held_keys=held
        )
        self._tracked[request.request_id] = tracked
        return tracked

    def _take_load(self, tracked: _Tracked, loads: list[LoadSpec]) -> None:
        if tracked.pending_load is not None:
            loads.append(tracked.pending_load)
            tracked.pending_load = None

    def _saves(self, tracked: _Tracked, num_computed: int, scheduler_output: Any) -> list[SaveSpec]:
        """Chunks whose K/V exists after this step and whose tokens are known, not yet stored.

        Draft tokens of speculative decoding may be rejected: their K/V is never saved.
        NOTE: by default only prompt positions are saved. K/V the engine wrote one token at
        a time while decoding differs in its last bits from what a prefill of the same
        tokens writes (other kernels), and in bf16 that is enough to change a later greedy
        token; a transcript's next agent prefills those answer tokens and stores them then.
        `save_decode` stores them at once (more reuse, outputs then match a recompute only
        up to that rounding, as with vLLM's own prefix cache).
        """
        request_id = tracked.request.request_id
        num_draft = len(scheduler_output.scheduled_spec_decode_tokens.get(request_id, ()))
        token_ids = tracked.request.all_token_ids
        ready = min(
            num_computed - num_draft, len(token_ids), len(tracked.block_ids) * self.block_size
        )
        if not self.save_decode:
            ready = min(ready, tracked.request.num_prompt_tokens)
        chain, saves = tracked.chain, []
        while chain.position + self.chunk_tokens <= ready:
            start = chain.position
            link = chain.extend(token_ids[start : start + self.chunk_tokens])
            if link.key in tracked.held_keys or link.key in self._recent_keys:
                continue
            self._remember(link.key)
            first, last = start // self.block_size, link.end // self.block_size
            saves.append(SaveSpec(
                request_id=request_id, namespace=tracked.namespace, start=start,
                token_ids=tuple(token_ids[start : link.end]), parent_key=link.parent_key,
                block_ids=tuple(tracked.block_ids[first:last]),
            ))  # fmt: skip
        return saves

    def _remember(self, key: bytes) -> None:
        self._recent_keys[key] = None
        if len(self._recent_keys) > MAX_RECENT_KEYS:
            self._recent_keys.popitem(last=False)


def _pieces(
    lookup: PrefixLookup, fingerprint: str, start: int, end: int
) -> tuple[StoredPiece, ...]:
    """The looked-up segments overlapping `[start, end)`, each with its parent key."""
    chain = KeyChain(fingerprint)
    pieces = []
    for ref in lookup.segments:
        if ref.start_position < end and ref.end_position > start:
            pieces.append(
                StoredPiece(ref.segment_id, ref.start_position, ref.num_tokens, chain.parent)
            )
        chain.follow(ref.context_key, ref.num_tokens)
    return tuple(pieces)
