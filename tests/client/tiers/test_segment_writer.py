"""The background writer: puts in order, stops a batch at its first failure, counts everything.

And `DirectPuts`, which puts the same way before it returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from helpers.store import FINGERPRINT, NAMESPACE

from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.client.tiers.segment_io import DirectPuts, SegmentWriter, SpanRecord
from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.results import ClientCounters


class RecordingStore:
    """Accepts puts until `fail_from` (then False, or ResourceExhausted with `raise_full`)."""

    namespace = NAMESPACE

    def __init__(self, fail_from: int = 1 << 30, raise_full: bool = False) -> None:
        self.counters = ClientCounters()
        self.metas: list[SegmentMeta] = []
        self.fail_from, self.raise_full = fail_from, raise_full
        self.gate = threading.Event()
        self.gate.set()

    def put_segment(self, meta: SegmentMeta, payload: bytes) -> bool:
        self.gate.wait()
        if len(self.metas) >= self.fail_from:
            if self.raise_full:
                raise ResourceExhausted("store is full")
            return False
        self.metas.append(meta)
        return True


def make_records(num: int) -> list[SpanRecord]:
    records, parent = [], root_key(FINGERPRINT)
    for index in range(num):
        keys = torch.randn(2, 2, 3, 8)
        kv = SegmentKV(keys, torch.randn_like(keys), start_position=3 * index)
        record = SpanRecord(kv, (index, index, index), parent, ())
        records.append(record)
        parent = record.context_key
    return records


def writer_for(store: RecordingStore, local: LocalTier | None = None) -> SegmentWriter:
    return SegmentWriter(store, fingerprint=FINGERPRINT, quant="none", local=local)


def keys_of(metas: Sequence[SegmentMeta]) -> list[bytes]:
    return [m.context_key for m in metas]


def test_batches_are_put_in_order_and_confirmed_locally() -> None:
    store, local = RecordingStore(), LocalTier(1 << 20)
    writer = writer_for(store, local)
    store.gate.clear()  # hold the thread: the entries are pending meanwhile
    metas = writer.submit(make_records(3))
    assert all(local.get(k).pending for k in keys_of(metas))  # type: ignore[union-attr]
    store.gate.set()
    writer.flush()
    assert keys_of(store.metas) == keys_of(metas)
    assert all(not local.get(k).pending for k in keys_of(metas))  # type: ignore[union-attr]
    assert (writer.counters.num_stored, writer.counters.num_failed) == (3, 0)
    writer.close()


def test_a_failed_put_stops_its_batch_and_drops_the_rest_locally() -> None:
    for store in (RecordingStore(fail_from=1), RecordingStore(fail_from=1, raise_full=True)):
        local = LocalTier(1 << 20)
        writer = writer_for(store, local)
        metas = writer.submit(make_records(3))
        writer.flush()
        assert keys_of(store.metas) == keys_of(metas[:1])
        assert (writer.counters.num_stored, writer.counters.num_failed) == (1, 2)
        assert local.get(metas[0].context_key) is not None
        assert all(local.get(k) is None for k in keys_of(metas[1:]))
        assert local.num_invalidations == 2
        writer.close()


def test_close_puts_what_is_queued() -> None:
    store = RecordingStore()
    writer = writer_for(store)
    for _ in range(4):
        writer.submit(make_records(2))
    writer.close()
    assert writer.counters.num_stored == 8 == len(store.metas)


def test_no_put_starts_while_paused() -> None:
    store = RecordingStore()
    writer = writer_for(store)
    with writer.paused():
        writer.submit(make_records(2))
        threading.Event().wait(0.1)  # ample time for the thread to have put them
        assert store.metas == []
    writer.flush()
    assert len(store.metas) == 2
    writer.close()


def test_direct_puts_store_in_order_until_one_fails_and_keep_the_stored_ones() -> None:
    store, local, records = RecordingStore(fail_from=2), LocalTier(1 << 20), make_records(3)
    puts = DirectPuts(store, fingerprint=FINGERPRINT, quant="none", local=local)
    stored = puts.submit(records)
    assert keys_of(stored) == keys_of(store.metas) == [r.context_key for r in records[:2]]
    held = [local.get(r.context_key) for r in records]
    assert [entry is not None and not entry.pending for entry in held] == [True, True, False]


def test_direct_puts_take_a_full_store_as_a_failed_put() -> None:
    store = RecordingStore(fail_from=1, raise_full=True)
    puts = DirectPuts(store, fingerprint=FINGERPRINT, quant="none", local=LocalTier(0))
    assert len(puts.submit(make_records(3))) == 1
