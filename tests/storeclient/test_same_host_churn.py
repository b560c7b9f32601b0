"""Two processes: this one (the worker) reads through the same-host path while the
sidecar process keeps writing, expiring, deleting and evicting. No read may return
torn bytes, a deleted version, or an expired segment; held views must not change."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from helpers.store import NAMESPACE, make_meta

from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.segment import SegmentMeta
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

PATIENT = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=30.0, put_timeout_s=30.0)
NUM_SLOTS = 12
PAYLOAD_NBYTES = 256 << 10
# Room for ~10 records, less the pages the reader's open snapshots pin: puts keep evicting.
MAP_SIZE_BYTES = 3 << 20
SHORT_TTL_S = 0.15
DURATION_S = 3.0


def payload_of(slot: int, version: int) -> bytes:
    return random.Random(slot * 1_000_003 + version).randbytes(PAYLOAD_NBYTES)


def meta_of(slot: int, version: int) -> SegmentMeta:
    ttl_s = SHORT_TTL_S if version % 2 else None
    meta = make_meta([7, slot], payload_of(slot, version), ttl_s=ttl_s)
    return replace(meta, labels=(("version", str(version)),))


@dataclass
class Version:
    put_done_s: float
    deleted_s: float | None = None  # when the delete that removed it returned


@dataclass(frozen=True)
class Read:
    slot: int
    version: int
    started_s: float
    expires_at_s: float | None


class Writer(threading.Thread):
    """Rewrites slot after slot through the sidecar: delete the old version, put the next."""

    def __init__(self, target: str) -> None:
        super().__init__(name="churn-writer", daemon=True)
        self.target = target
        self.versions: dict[tuple[int, int], Version] = {}
        self.num_evicted = 0
        self.num_refused = 0  # map full of pages pinned by reads: the store says so
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        current = dict.fromkeys(range(NUM_SLOTS), -1)
        try:
            with StoreClient(self.target, NAMESPACE, config=PATIENT) as client:
                for step in range(10**9):
                    if self.stop.is_set():
                        return
                    slot = step % NUM_SLOTS
                    if self._rewrite(client, slot, current[slot]):
                        current[slot] += 1
                    time.sleep(0.01)
        except BaseException as exc:
            self.error = exc

    def _rewrite(self, client: StoreClient, slot: int, version: int) -> bool:
        """Replace `version` of `slot` by the next; False if the store had no room."""
        if version >= 0 and self.versions[slot, version].deleted_s is None:
            held = client.delete(meta_of(slot, version).segment_id)
            self.versions[slot, version].deleted_s = time.time()
            self.num_evicted += not held  # capacity eviction got there first
        new = version + 1
        try:
            assert client.put_segment(meta_of(slot, new), payload_of(slot, new))
        except ResourceExhausted:
            self.num_refused += 1
            return False
        self.versions[slot, new] = Version(put_done_s=time.time())
        return True


def check_unchanged(held: list[tuple[int, int, memoryview]]) -> None:
    """Views read earlier still hold their bytes (a function: no loop variable outlives it)."""
    for slot, version, payload in held:
        assert bytes(payload) == payload_of(slot, version)


@pytest.fixture()
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    # The sidecar sweeps expired segments away while the worker reads.
    spec = SidecarSpec(str(tmp_path / "lmdb"), map_size_bytes=MAP_SIZE_BYTES, sweep_interval_s=0.1)
    with SidecarProcess(spec) as process:
        yield process


def test_reads_under_churn_are_never_torn_stale_or_expired(sidecar: SidecarProcess) -> None:
    writer = Writer(sidecar.target)
    reads: list[Read] = []
    held: list[tuple[int, int, memoryview]] = []  # views kept across later rewrites
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as reader:
        writer.start()
        deadline_s = time.monotonic() + DURATION_S
        rng = random.Random(0)
        for attempt in itertools.count():
            if time.monotonic() > deadline_s:
                break
            if attempt % 50 == 0:  # a held view pins its snapshot's pages: let go in time
                check_unchanged(held)
                held.clear()
            # NOTE: the writer is a thread of this process: a read loop that never
            # sleeps starves it of the GIL, and then nothing churns.
            time.sleep(0.002)
            slot = rng.randrange(NUM_SLOTS)
            started_s = time.time()
            found = reader.get_segment(meta_of(slot, 0).segment_id)
            if found is None:
                continue
            meta, payload = found
            version = int(dict(meta.labels)["version"])
            assert bytes(payload) == payload_of(slot, version)  # whole and consistent
            expires_at_s = None if meta.ttl_s is None else meta.created_at_s + meta.ttl_s
            reads.append(Read(slot, version, started_s, expires_at_s))
            if len(held) < 2:
                held.append((slot, version, payload))
            del found, payload
        writer.stop.set()
        writer.join(30)
        assert writer.error is None, writer.error
        check_unchanged(held)
        held.clear()
        assert reader.counters.num_same_host_reads > 0
        assert reader.counters.num_corrupt_payloads == 0
        assert reader.counters.num_degraded_calls == 0
    for read in reads:
        deleted_s = writer.versions[read.slot, read.version].deleted_s
        assert deleted_s is None or deleted_s > read.started_s, f"stale read {read}"
        assert read.expires_at_s is None or read.expires_at_s >= read.started_s, read
    assert len(reads) >= 20 and writer.num_evicted > 0, (len(reads), writer.num_evicted)
    assert len(writer.versions) >= 3 * NUM_SLOTS, writer.num_refused
    assert any(read.expires_at_s is not None for read in reads)
