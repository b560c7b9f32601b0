"""The same-host read path: a worker process reading a sidecar process's LMDB in place.

The sidecar runs in a child process (LMDB forbids a process to open an environment
twice); the test process is the worker. No torch needed.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.store import NAMESPACE, OTHER_FINGERPRINT, make_meta, make_payload

from kvsplice.common.errors import FingerprintMismatch
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

PATIENT = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=30.0, put_timeout_s=30.0)
OVER_GRPC = replace(PATIENT, same_host_reads=False)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    path = tmp_path_factory.mktemp("same-host") / "lmdb"
    with SidecarProcess(SidecarSpec(str(path), map_size_bytes=64 << 20)) as process:
        yield process


def test_a_get_on_the_sidecars_host_reads_in_place_and_equals_grpc(
    sidecar: SidecarProcess,
) -> None:
    payload = make_payload(3 << 20, seed=1)
    meta = make_meta([11, 12, 13], payload)
    with (
        StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as local,
        StoreClient(sidecar.target, NAMESPACE, config=OVER_GRPC) as remote,
    ):
        assert local.put_segment(meta, payload)
        found_local = local.get_segment(meta.segment_id)
        found_remote = remote.get_segment(meta.segment_id)
        assert found_local is not None and found_remote is not None
        assert found_local[0].context_key == found_remote[0].context_key == meta.context_key
        assert bytes(found_local[1]) == bytes(found_remote[1]) == payload
        assert isinstance(found_local[1], memoryview) and found_local[1].readonly
        assert local.counters.num_same_host_reads == 1
        assert remote.counters.num_same_host_reads == 0


def test_same_host_misses_expired_foreign_and_absent_segments(sidecar: SidecarProcess) -> None:
    payload = make_payload(4096, seed=2)
    short = make_meta([21, 22], payload, ttl_s=0.3)
    lasting = make_meta([23, 24], payload)
    with (
        StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as client,
        StoreClient(sidecar.target, "tenant-b", config=PATIENT) as other_tenant,
    ):
        assert client.put_segment(short, payload) and client.put_segment(lasting, payload)
        assert client.get_segment(short.segment_id) is not None
        time.sleep(0.5)
        assert client.get_segment(short.segment_id) is None  # still in LMDB, but expired
        assert other_tenant.get_segment(lasting.segment_id) is None
        assert client.get_segment(make_meta([99], payload).segment_id) is None
        with pytest.raises(FingerprintMismatch):
            client.get_segment(lasting.segment_id, model_fingerprint=OTHER_FINGERPRINT)
        assert client.counters.num_same_host_reads == 3  # hit, expired, absent
        assert other_tenant.counters.num_same_host_reads == 1


def test_a_view_outlives_the_segment_it_was_read_from(sidecar: SidecarProcess) -> None:
    """The read transaction stays open while the caller holds the view: deleting the
    segment and reusing its pages cannot change bytes already returned."""
    payload = make_payload(2 << 20, seed=3)
    meta = make_meta([31, 32], payload)
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as client:
        assert client.put_segment(meta, payload)
        found = client.get_segment(meta.segment_id)
        assert found is not None and client.delete(meta.segment_id)
        for seed in range(8):  # new records, which may take the freed pages once unpinned
            other = make_payload(2 << 20, seed=100 + seed)
            assert client.put_segment(make_meta([33, seed], other), other)
        assert bytes(found[1]) == payload
        assert client.get_segment(meta.segment_id) is None


def test_an_in_process_store_is_read_over_grpc(tmp_path: Path) -> None:
    payload = make_payload(1024, seed=4)
    meta = make_meta([41], payload)
    with (
        EmbeddedStore(loopback_config(str(tmp_path / "lmdb"))) as store,
        StoreClient(store.target, NAMESPACE, config=PATIENT) as client,
    ):
        assert client.put_segment(meta, payload)
        found = client.get_segment(meta.segment_id)
        assert found is not None and bytes(found[1]) == payload
        assert client.counters.num_same_host_reads == 0


def test_a_sidecar_started_over_at_the_same_path_is_never_read_through_the_old_map(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "lmdb")
    payload = make_payload(4096, seed=6)
    meta = make_meta([61, 62], payload)
    with SidecarProcess(SidecarSpec(path, map_size_bytes=8 << 20)) as first:
        client = StoreClient(first.target, NAMESPACE, config=replace(PATIENT, get_timeout_s=1.0))
        assert client.put_segment(meta, payload)
        assert client.get_segment(meta.segment_id) is not None
        first.stop()
        shutil.rmtree(path)
        with SidecarProcess(SidecarSpec(path, map_size_bytes=8 << 20)) as second:
            # The old map still holds the segment; the client must notice the new files.
            assert client.get_segment(meta.segment_id) is None
            assert client.counters.num_same_host_reads == 1
            client.close()
            with StoreClient(second.target, NAMESPACE, config=PATIENT) as fresh:
                assert fresh.get_segment(meta.segment_id) is None
                assert fresh.counters.num_same_host_reads == 1
