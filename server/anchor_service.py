"""Anchor pools (KVComm) as a store service: pool state and payloads live in store blobs.

Per namespace, one blob holds the pools (loaded on first use, so they survive restarts)
and each anchor payload is a blob. Offset math is the client's; eviction `index.anchor_pool`'s.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvsplice.common.errors import InvalidRequest, ResourceExhausted
from kvsplice.index.anchor_pool import AnchorEntry, AnchorPool, AnchorPoolConfig, AnchorPools
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.request_checks import check_fingerprint, check_namespace
from kvsplice.storage.tiered_store import TieredStore

logger = logging.getLogger(__name__)

POOLS_BLOB = "anchors/pools"
# No "/" in ids: they are path components of blob names (at most 256 bytes in all).
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")  # fullmatch: no "id\n"


@dataclass(frozen=True)
class AnchorWrite:
    """A PutAnchor request: the placeholder's base payload and per-agent offsets."""

    namespace: str
    model_fingerprint: str
    placeholder_id: str
    anchor_id: str
    base_payload: bytes
    agent_payloads: Mapping[str, bytes]
    num_tokens: int


@dataclass(frozen=True)
class AnchorRecord:
    """One pooled anchor; payloads are empty unless they were asked for."""

    anchor_id: str
    num_tokens: int
    activation_count: int
    created_seq: int
    agent_ids: tuple[str, ...] = ()
    base_payload: bytes = b""
    agent_payloads: Mapping[str, bytes] = field(default_factory=dict)


def check_id(name: str, value: str) -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise InvalidRequest(f"{name} {value[:80]!r} must match {ID_PATTERN.pattern}")
    return value


def _payload_blob(
    fingerprint: str, placeholder_id: str, anchor_id: str, agent_id: str | None
) -> str:
    base = f"anchors/{fingerprint}/{placeholder_id}/{anchor_id}"
    return f"{base}/base" if agent_id is None else f"{base}/agent/{agent_id}"


class AnchorService:
    """Put, read and touch anchors; pools evict by `AnchorPoolConfig`'s rule."""

    def __init__(
        self, store: TieredStore, pool_config: AnchorPoolConfig, config: SegmentServiceConfig
    ) -> None:
        self._store = store
        self._pool_config = pool_config
        self.config = config
        self._pools_by_namespace: dict[str, AnchorPools] = {}
        store.add_blob_listener(self._on_blob_changed)

    def put(self, write: AnchorWrite) -> list[str]:
        """Pool the anchor, or add agents' offsets to it; return the ids the pool evicted.

        A present anchor keeps its base (offsets were taken against it: a new
        base would silently invalidate them), its creation order and its
        activation count; the write's agents are added or replaced and the other
        agents' offsets stay. So each agent can put its own offsets alone, and an
        anchor is bounded by what one request may carry only per agent.
        """
        self._check_write(write)
        ns, fp, ph = write.namespace, write.model_fingerprint, write.placeholder_id
        pools = self._pools(ns)
        pool = pools.get_or_create(ns, fp, ph)
        previous = {entry.anchor_id: entry for entry in pool.entries()}
        present = previous.get(write.anchor_id)
        base_blob = _payload_blob(fp, ph, write.anchor_id, None)
        if present is not None and self._store.get_blob(ns, base_blob) is None:
            # The store evicted the base: the other agents' offsets were taken against
            # it, so the anchor starts again from this write (a new incarnation).
            logger.warning("anchor %s/%s lost its base; pooled again", ph, write.anchor_id)
            pool.remove(write.anchor_id)
            self._delete_payloads(ns, fp, ph, present)
            del previous[write.anchor_id]
            present = None
        if present is None:
            self._store.put_blob(ns, base_blob, write.base_payload)
        for agent_id, payload in write.agent_payloads.items():
            self._store.put_blob(ns, _payload_blob(fp, ph, write.anchor_id, agent_id), payload)
        if present is not None:
            present.agent_ids = tuple(sorted({*present.agent_ids, *write.agent_payloads}))
            evicted: list[str] = []
        else:
            entry = AnchorEntry(
                anchor_id=write.anchor_id,
                num_tokens=write.num_tokens,
                created_seq=pool.next_seq(),
                agent_ids=tuple(sorted(write.agent_payloads)),
            )
            evicted = pool.add(entry)
        self._save(ns, pools)
        for anchor_id in evicted:
            self._delete_payloads(ns, fp, ph, previous[anchor_id])
        return evicted

    def get(
        self,
        namespace: str,
        fingerprint: str,
        placeholder_id: str,
        include_payloads: bool,
        anchor_ids: Sequence[str] = (),
        agent_id: str = "",
    ) -> list[AnchorRecord]:
        """The placeholder's anchors (only `anchor_ids` when given), oldest first; [] if none.

        `agent_id` keeps only that agent's offset payloads. Payloads in one
        answer are capped at `max_anchor_nbytes` (every single anchor fits):
        over it, ResourceExhausted tells the caller to ask for fewer ids.
        """
        for anchor_id in anchor_ids:
            check_id("anchor_id", anchor_id)
        if agent_id:
            check_id("agent_id", agent_id)
        pool = self._find_pool(namespace, fingerprint, placeholder_id)
        if pool is None:
            return []
        wanted = set(anchor_ids)
        records: list[AnchorRecord] = []
        nbytes = 0
        for entry in pool.entries():
            if wanted and entry.anchor_id not in wanted:
                continue
            record = self._record(
                namespace, fingerprint, placeholder_id, pool, entry, include_payloads, agent_id
            )
            if record is None:
                continue
            nbytes += len(record.base_payload) + sum(map(len, record.agent_payloads.values()))
            if len(records) >= 1 and nbytes > self.config.max_anchor_nbytes:
                raise ResourceExhausted(
                    f"anchor payloads exceed {self.config.max_anchor_nbytes} bytes in one "
                    "answer; ask for fewer anchor_ids"
                )
            records.append(record)
        return records

    def touch(
        self, namespace: str, fingerprint: str, placeholder_id: str, anchor_ids: Sequence[str]
    ) -> int:
        """Count one activation of each pooled id; returns how many were pooled."""
        pool = self._find_pool(namespace, fingerprint, placeholder_id)
        if pool is None:
            return 0
        pooled = [i for i in anchor_ids if pool.get(i) is not None]
        if pooled:
            pool.touch(pooled)
            self._save(namespace, self._pools(namespace))
        return len(pooled)

    def forget_namespace(self, namespace: str) -> None:
        """Drop the cached pools of a namespace whose blobs were just deleted (a flush)."""
        self._pools_by_namespace.pop(namespace, None)

    def _check_write(self, write: AnchorWrite) -> None:
        check_namespace(write.namespace)
        check_fingerprint(write.model_fingerprint)
        check_id("placeholder_id", write.placeholder_id)
        check_id("anchor_id", write.anchor_id)
        for agent_id in write.agent_payloads:
            check_id("agent_id", agent_id)
        limits = self.config
        if len(write.agent_payloads) > limits.max_agents_per_anchor:
            raise InvalidRequest(
                f"{len(write.agent_payloads)} agents > limit {limits.max_agents_per_anchor}"
            )
        if not 0 < write.num_tokens <= limits.max_segment_tokens:
            raise InvalidRequest(
                f"num_tokens {write.num_tokens} not in [1, {limits.max_segment_tokens}]"
            )
        if not write.base_payload:
            raise InvalidRequest("base_payload is empty")
        nbytes = len(write.base_payload) + sum(len(p) for p in write.agent_payloads.values())
        if nbytes > limits.max_anchor_nbytes:
            raise InvalidRequest(
                f"anchor payloads hold {nbytes} bytes > limit {limits.max_anchor_nbytes}"
            )

    def _find_pool(
        self, namespace: str, fingerprint: str, placeholder_id: str
    ) -> AnchorPool | None:
        check_namespace(namespace)
        check_fingerprint(fingerprint)
        check_id("placeholder_id", placeholder_id)
        return self._pools(namespace).get(namespace, fingerprint, placeholder_id)

    def _record(
        self,
        ns: str,
        fp: str,
        ph: str,
        pool: AnchorPool,
        entry: AnchorEntry,
        include_payloads: bool,
        agent_id: str = "",
    ) -> AnchorRecord | None:
        """The entry as a record, with its payloads when asked; None (and unpooled, see
        `_forget_lost`) when the store evicted a payload it needs."""
        record = AnchorRecord(
            entry.anchor_id,
            entry.num_tokens,
            entry.activation_count,
            entry.created_seq,
            agent_ids=tuple(entry.agent_ids),
        )
        if not include_payloads:
            return record
        base = self._store.get_blob(ns, _payload_blob(fp, ph, entry.anchor_id, None))
        agents = {
            a: self._store.get_blob(ns, _payload_blob(fp, ph, entry.anchor_id, a))
            for a in entry.agent_ids
            if not agent_id or a == agent_id
        }
        lost = set(entry.agent_ids) if base is None else {a for a, p in agents.items() if p is None}
        if base is None or lost:
            logger.warning("anchor %s/%s lost payload blobs; served as a miss", ph, entry.anchor_id)
            self._forget_lost(ns, fp, ph, pool, entry, lost)
            return None
        return replace(
            record,
            base_payload=base,
            agent_payloads={a: p for a, p in agents.items() if p is not None},
        )

    def _forget_lost(
        self, ns: str, fp: str, ph: str, pool: AnchorPool, entry: AnchorEntry, lost: set[str]
    ) -> None:
        """Unpool what the store evicted: `lost` agents leave the anchor (all of them when
        its base is gone), and an anchor with no agent left leaves the pool."""
        entry.agent_ids = tuple(a for a in entry.agent_ids if a not in lost)
        if not entry.agent_ids:
            pool.remove(entry.anchor_id)
            self._delete_payloads(ns, fp, ph, replace(entry, agent_ids=tuple(lost)))
        self._save(ns, self._pools(ns))

    def _delete_payloads(self, ns: str, fp: str, ph: str, entry: AnchorEntry) -> None:
        """Delete an evicted `entry`'s blobs: its base and every agent's offsets."""
        self._store.delete_blob(ns, _payload_blob(fp, ph, entry.anchor_id, None))
        for agent_id in entry.agent_ids:
            self._store.delete_blob(ns, _payload_blob(fp, ph, entry.anchor_id, agent_id))

    def _pools(self, namespace: str) -> AnchorPools:
        """The namespace's pools, loaded from their blob on first use."""
        pools = self._pools_by_namespace.get(namespace)
        if pools is None:
            pools = self._load(namespace)
            self._pools_by_namespace[namespace] = pools
        return pools

    def _load(self, namespace: str) -> AnchorPools:
        data = self._store.get_blob(namespace, POOLS_BLOB)
        if data is None:
            return AnchorPools(self._pool_config)
        try:
            return AnchorPools.from_bytes(data, self._pool_config)
        except ValueError as error:
            # A cache may forget: start empty (payload blobs are overwritten on reuse).
            logger.warning("anchor pools of %r unreadable (%s); starting empty", namespace, error)
            return AnchorPools(self._pool_config)

    def _on_blob_changed(self, namespace: str, name: str) -> None:
        """Another sidecar rewrote `namespace`'s pools: reload them on next use.

        NOTE: pools are last-writer-wins across sidecars (each write is a whole pool,
        never above capacity); a concurrent write may drop the other's new anchor.
        """
        if name == POOLS_BLOB:
            self._pools_by_namespace.pop(namespace, None)

    def _save(self, namespace: str, pools: AnchorPools) -> None:
        self._store.put_blob(namespace, POOLS_BLOB, pools.to_bytes())
