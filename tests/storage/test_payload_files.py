"""Payload files: staged payloads adopted beside LMDB (renamed in, never copied), read back,
removed with their records, checked on every load, and consistent across a crash."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.staging import HEAD_ROOM_NBYTES, is_spare, map_staged, new_name
from kvsplice.storage.config import LMDBTierConfig, RedisTierConfig, StoreConfig, build_store
from kvsplice.storage.lmdb_reader import LMDBReader, data_file_id
from kvsplice.storage.lmdb_tier import LMDBTier
from kvsplice.storage.payload_files import PayloadRef, map_payload
from kvsplice.storage.segment_codec import VerifiedPayload
from kvsplice.storage.tiered_store import TieredStore
from kvsplice.storeclient.put_staging import PutStaging

MIB = 1 << 20


def open_store(path: Path, map_size_bytes: int = 64 * MIB, **overrides: object) -> TieredStore:
    lmdb = LMDBTierConfig(str(path / "lmdb"), map_size_bytes=map_size_bytes, sync=False)
    return build_store(StoreConfig(lmdb=lmdb, **overrides))  # type: ignore[arg-type]


def staged(path: Path, payload: bytes, staging: Path | None = None) -> VerifiedPayload:
    """`payload` in a staging file of `staging` (`path`/staging: not the LMDB directory's
    own, so no spare is handed back), as the server hands it to the store."""
    staging = path / "staging" if staging is None else staging
    staging.mkdir(exist_ok=True)
    name = new_name()
    with open(staging / name, "wb") as file:
        file.seek(HEAD_ROOM_NBYTES)
        file.write(payload)
    buffer = map_staged(str(staging), name, HEAD_ROOM_NBYTES, len(payload))
    return VerifiedPayload(buffer.buffer, buffer.offset, buffer.staged)


def put_one(store: TieredStore, path: Path, make_segment, seed: int, staging: Path | None = None):
    """One 2 MiB segment put staged (in `staging`, see `staged`); its (meta, payload)."""
    meta, payload = make_segment(nbytes=2 * MIB, seed=seed)
    store.put(meta, staged(path, payload, staging))
    return meta, payload


def payload_files(path: Path, num_expected: int | None = None) -> list[Path]:
    """The payload folder's files, once `num_expected` (removals are unlinked by a thread
    of the folder's own: a short wait)."""
    deadline = time.monotonic() + 10
    while True:
        files = sorted((path / "lmdb" / "payloads").iterdir())
        if num_expected in (None, len(files)) or time.monotonic() > deadline:
            return files
        time.sleep(0.01)


def staging_files(path: Path) -> list[Path]:
    return sorted((path / "staging").iterdir())


def test_an_adopted_payload_reads_back_and_goes_with_its_record(
    tmp_path: Path, make_segment
) -> None:
    store = open_store(tmp_path)
    meta, payload = put_one(store, tmp_path, make_segment, seed=1)
    assert staging_files(tmp_path) == [] and len(payload_files(tmp_path)) == 1  # renamed in
    durable = store.stats().tiers["lmdb"]
    found = store.get(meta.namespace, meta.context_key)
    assert found is not None and bytes(found.payload) == payload
    lmdb = store._stack.durable
    assert lmdb.used_bytes() >= len(payload)  # the file's bytes count against the budget
    replacement = replace(meta, created_at_s=meta.created_at_s + 1)
    store.put(replacement, staged(tmp_path, payload))  # a replaced record's file goes too
    assert len(payload_files(tmp_path, 1)) == 1
    assert store.delete(meta.namespace, meta.context_key)
    assert payload_files(tmp_path, 0) == [] and lmdb.used_bytes() < MIB
    assert durable.puts == 1 and durable.checksum_failures == 0
    store.close()


def test_capacity_eviction_removes_the_files_of_the_evicted(tmp_path: Path, make_segment) -> None:
    store = open_store(tmp_path, map_size_bytes=7 * MIB)
    segments = [make_segment(token_ids=(i,), nbytes=2 * MIB, seed=i) for i in range(6)]
    for meta, payload in segments:
        store.put(meta, staged(tmp_path, payload))
    held = [m for m, _ in segments if store.get_meta(m.namespace, m.context_key) is not None]
    assert 0 < len(held) < len(segments)
    assert len(payload_files(tmp_path, len(held))) == len(held)
    assert store._stack.durable.used_bytes() <= 7 * MIB
    for meta, payload in segments[-len(held) :]:
        found = store.get(meta.namespace, meta.context_key)
        assert found is not None and bytes(found.payload) == payload
    store.close()


def test_a_corrupt_payload_file_is_a_counted_miss_and_is_removed(
    tmp_path: Path, make_segment
) -> None:
    store = open_store(tmp_path)
    meta, payload = put_one(store, tmp_path, make_segment, seed=2)
    (file,) = payload_files(tmp_path)
    with open(file, "r+b") as handle:
        handle.seek(HEAD_ROOM_NBYTES + 12345)
        handle.write(bytes([payload[12345] ^ 0xFF]))
    assert store.get(meta.namespace, meta.context_key) is None
    assert store.stats().tiers["lmdb"].checksum_failures == 1
    assert payload_files(tmp_path, 0) == []
    assert store.get_meta(meta.namespace, meta.context_key) is None
    store.close()


def test_in_place_reads_map_the_file_verify_it_and_miss_once_it_is_gone(
    tmp_path: Path, make_segment
) -> None:
    store = open_store(tmp_path)
    (meta, payload), (other, other_payload) = (
        make_segment(token_ids=(i,), nbytes=2 * MIB, seed=i) for i in (3, 4)
    )
    store.put(meta, staged(tmp_path, payload))
    store.put(other, staged(tmp_path, other_payload))
    store.close()  # LMDB opens an environment once per process: the reader after the writer
    path = str(tmp_path / "lmdb")
    files = payload_files(tmp_path)
    reader = LMDBReader.acquire(path, data_file_id(path))
    try:
        found = reader.read(meta.namespace, meta.context_key)
        assert found is not None and bytes(found.payload) == payload
        for file in files:
            file.unlink()  # (a removal after the reader's snapshot of the records)
        assert reader.read(meta.namespace, meta.context_key) is None
        assert bytes(found.payload) == payload  # a mapping outlives its file's removal
        Path(files[0]).write_bytes(b"\0" * (HEAD_ROOM_NBYTES + 2 * MIB))
        Path(files[1]).write_bytes(b"\0" * (HEAD_ROOM_NBYTES + 2 * MIB))
        with pytest.raises(CorruptPayload):
            reader.read(other.namespace, other.context_key)
    finally:
        reader.release()


def _killed_between_rename_and_commit(path: Path, make_segment) -> None:
    store = open_store(path)
    meta, payload = make_segment(token_ids=(1,), nbytes=2 * MIB, seed=5)
    store.put(meta, staged(path, payload))

    def killed(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    LMDBTier._commit = killed  # type: ignore[method-assign]
    meta, payload = make_segment(token_ids=(2,), nbytes=2 * MIB, seed=6)
    store.put(meta, staged(path, payload))


def test_a_crash_between_rename_and_commit_leaves_no_orphan_and_no_bad_record(
    tmp_path: Path, make_segment
) -> None:
    child = multiprocessing.get_context("fork").Process(
        target=_killed_between_rename_and_commit, args=(tmp_path, make_segment)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert len(payload_files(tmp_path)) == 2  # the second was renamed in, never committed
    store = open_store(tmp_path)
    assert len(payload_files(tmp_path)) == 1  # the orphan is collected at open
    first, first_payload = make_segment(token_ids=(1,), nbytes=2 * MIB, seed=5)
    second, _ = make_segment(token_ids=(2,), nbytes=2 * MIB, seed=6)
    found = store.get(first.namespace, first.context_key)
    assert found is not None and bytes(found.payload) == first_payload
    assert store.get_meta(second.namespace, second.context_key) is None
    assert store.stats().tiers["lmdb"].checksum_failures == 0
    store.close()


def test_a_record_whose_file_is_missing_at_open_is_dropped_and_counted(
    tmp_path: Path, make_segment
) -> None:
    store = open_store(tmp_path)
    segments = [make_segment(token_ids=(i,), nbytes=2 * MIB, seed=i) for i in (7, 8)]
    for meta, payload in segments:
        store.put(meta, staged(tmp_path, payload))
    store.close()
    lost = {f.stat().st_mtime_ns: f for f in payload_files(tmp_path)}
    lost[min(lost)].unlink()  # the first segment's file
    store = open_store(tmp_path)
    assert store.stats().tiers["lmdb"].checksum_failures == 1
    (meta, _), (kept, kept_payload) = segments
    assert store.get_meta(meta.namespace, meta.context_key) is None
    found = store.get(kept.namespace, kept.context_key)
    assert found is not None and bytes(found.payload) == kept_payload
    store.close()


def test_a_staged_file_on_another_filesystem_is_copied(tmp_path: Path, make_segment) -> None:
    store = open_store(tmp_path)
    meta, payload = make_segment(nbytes=2 * MIB, seed=9)
    payload_in = staged(tmp_path, payload)
    assert payload_in.staged is not None
    elsewhere = replace(payload_in.staged, device=payload_in.staged.device + 1)
    store.put(meta, replace(payload_in, staged=elsewhere))
    assert len(staging_files(tmp_path)) == 1 and payload_files(tmp_path) == []  # copied
    found = store.get(meta.namespace, meta.context_key)
    assert found is not None and bytes(found.payload) == payload
    store.close()


@pytest.mark.redis
def test_the_shared_tier_publishes_an_adopted_payload(
    tmp_path: Path, make_segment, redis_client
) -> None:
    redis = RedisTierConfig(key_prefix=f"kvs-test-{uuid.uuid4().hex[:8]}:")
    writer = open_store(tmp_path / "a", redis=redis)
    reader = open_store(tmp_path / "b", redis=redis)
    try:
        meta, payload = make_segment(nbytes=2 * MIB, seed=10)
        writer.put(meta, staged(tmp_path / "a", payload))
        assert len(payload_files(tmp_path / "a")) == 1
        deadline = time.monotonic() + 10
        found = None
        while found is None and time.monotonic() < deadline:
            found = reader.get(meta.namespace, meta.context_key)  # read through the cluster
            time.sleep(0.05)
        assert found is not None and bytes(found.payload) == payload
    finally:
        writer.close()
        reader.close()
        for key in redis_client.scan_iter(f"{redis.key_prefix}*"):
            redis_client.delete(key)


def spares(staging: Path) -> list[Path]:
    return sorted(p for p in staging.iterdir() if is_spare(p.name))


def test_a_removed_file_goes_back_as_a_spare_that_the_next_staged_put_reuses(
    tmp_path: Path, make_segment
) -> None:
    """A client writes its next payload into pages the page cache already holds."""
    store = open_store(tmp_path)
    staging = tmp_path / "lmdb" / "staging"  # the LMDB directory's own (`--staging-dir auto`)
    meta, payload = put_one(store, tmp_path, make_segment, seed=11, staging=staging)
    (file,) = payload_files(tmp_path)
    inode = file.stat().st_ino
    assert store.delete(meta.namespace, meta.context_key)
    assert payload_files(tmp_path, 0) == []
    deadline = time.monotonic() + 10
    while not spares(staging) and time.monotonic() < deadline:
        time.sleep(0.01)
    (spare,) = spares(staging)
    assert spare.stat().st_ino == inode
    client = PutStaging(str(staging))
    with client.staged(payload) as where:
        assert where is not None and (staging / where[0]).stat().st_ino == inode  # claimed
    assert spares(staging) == []
    client.close()
    store.close()


def test_a_file_a_reader_maps_is_never_handed_back(tmp_path: Path, make_segment) -> None:
    """Its next writer would change the bytes under a reader that verified them."""
    store = open_store(tmp_path)
    staging = tmp_path / "lmdb" / "staging"
    meta, payload = put_one(store, tmp_path, make_segment, seed=12, staging=staging)
    (file,) = payload_files(tmp_path)
    ref = PayloadRef(file.name, HEAD_ROOM_NBYTES, len(payload))
    mapped = map_payload(str(tmp_path / "lmdb"), ref)
    assert mapped is not None
    assert store.delete(meta.namespace, meta.context_key)
    assert payload_files(tmp_path, 0) == []  # the reaper has decided (a rename or an unlink)
    assert spares(staging) == [] and bytes(mapped) == payload  # unlinked, not handed back
    store.close()
