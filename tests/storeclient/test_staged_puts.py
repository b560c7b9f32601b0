"""Staged puts: a worker on the sidecar's host hands payloads over in a file, not a stream.

The sidecar runs in a child process, the test process is the worker (as in
test_same_host.py). Each sidecar gets its own staging folder under tmp_path, so the
tests see exactly the files they made. No torch needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from helpers.store import NAMESPACE, make_meta, make_payload

from kvsplice.common.staging import STALE_AFTER_S, map_staged, new_name, sweep_stale
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storage.payload_files import PAYLOAD_DIR
from kvsplice.storeclient import wire
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.put_staging import MIN_STAGED_NBYTES, PutStaging

PATIENT = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=30.0, put_timeout_s=30.0)
STREAMED = replace(PATIENT, staged_puts=False, same_host_reads=False)


@pytest.fixture(scope="module")
def staging_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def sidecar(
    tmp_path_factory: pytest.TempPathFactory, staging_dir: Path
) -> Iterator[SidecarProcess]:
    path = tmp_path_factory.mktemp("staged-puts") / "lmdb"
    spec = SidecarSpec(str(path), map_size_bytes=128 << 20, staging_dir=str(staging_dir))
    with SidecarProcess(spec) as process:
        yield process


def _staging_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("kvsplice-staging-"))


def test_a_large_put_is_staged_and_reads_back_equal_to_a_streamed_one(
    sidecar: SidecarProcess, staging_dir: Path
) -> None:
    big, small = make_payload(3 << 20, seed=1), make_payload(MIN_STAGED_NBYTES - 1, seed=2)
    staged_meta, small_meta = make_meta([1, 2, 3], big), make_meta([4, 5], small)
    streamed_meta = make_meta([6, 7], big)
    with (
        StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as client,
        StoreClient(sidecar.target, NAMESPACE, config=STREAMED) as streaming,
    ):
        assert client.put_segment(staged_meta, big)
        assert client.put_segment(small_meta, small)  # too small to be worth a file
        assert streaming.put_segment(streamed_meta, big)
        assert client.counters.num_staged_puts == 1
        assert streaming.counters.num_staged_puts == 0
        # the staged file was adopted as the payload's own (same filesystem: renamed, no
        # copy); the next staged put makes a fresh one
        assert _staging_files(staging_dir) == []
        payload_files = Path(sidecar.spec.lmdb_path) / PAYLOAD_DIR
        assert len(list(payload_files.iterdir())) == 1
        for meta, payload in ((staged_meta, big), (small_meta, small), (streamed_meta, big)):
            found = streaming.get_segment(meta.segment_id)  # over gRPC: the sidecar's copy
            assert found is not None and bytes(found[1]) == payload
        bigger = make_payload(5 << 20, seed=3)
        assert client.put_segment(make_meta([8], bigger), bigger)
        found = streaming.get_segment(make_meta([8], bigger).segment_id)
        assert found is not None and bytes(found[1]) == bigger
        assert client.counters.num_staged_puts == 2
    assert _staging_files(staging_dir) == []  # close removed it


def test_staged_bytes_are_verified_by_every_load(
    sidecar: SidecarProcess, staging_dir: Path
) -> None:
    """A staged payload whose bytes differ from what its header promises is stored unread
    (the sidecar does not hash staged puts) and read as a miss, counted and removed, so
    that a put of the right bytes then stores them; a name that is not a staging file, a
    missing one, a short one or a symlink is NOT_FOUND."""
    payload = make_payload(1 << 20, seed=4)
    meta = wire.with_payload_digest(make_meta([40, 41], payload), payload)
    staging = PutStaging(str(staging_dir))
    with grpc.insecure_channel(sidecar.target) as channel:
        put = channel.unary_unary(*wire.PUT_STAGED_SEGMENT)

        def status(name: str, offset: int = 0) -> grpc.StatusCode:
            try:
                put(wire.staged_put_request(meta, name, offset), timeout=30)
            except grpc.RpcError as error:
                return error.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

        tampered = bytearray(payload)
        tampered[12345] ^= 0xFF
        with staging.staged(bytes(tampered)) as where:
            assert where is not None
            past_end = os.path.getsize(staging_dir / where[0]) - len(payload) + 1
            assert status(where[0], past_end) is grpc.StatusCode.NOT_FOUND  # runs past the end
            assert status(*where) is grpc.StatusCode.OK  # stored, its bytes unread
        with StoreClient(sidecar.target, NAMESPACE, config=STREAMED) as client:
            assert client.get_segment(meta.segment_id) is None  # verified on load: a miss
        for name in ("../../etc/passwd", "lmdb", new_name()):  # not ours / not a name / absent
            assert status(name) is grpc.StatusCode.NOT_FOUND, name
        link = staging_dir / new_name()
        with staging.staged(payload) as where:
            assert where is not None
            link.symlink_to(staging_dir / where[0])
            assert status(link.name) is grpc.StatusCode.NOT_FOUND  # never followed
            assert status(*where) is grpc.StatusCode.OK  # the file itself is fine
        link.unlink()
    staging.close()
    with StoreClient(sidecar.target, NAMESPACE, config=STREAMED) as client:
        found = client.get_segment(meta.segment_id)
        assert found is not None and bytes(found[1]) == payload


def test_a_sidecar_that_cannot_read_the_file_gets_the_put_streamed(
    sidecar: SidecarProcess, tmp_path: Path
) -> None:
    """Another folder than the sidecar's (a container's own /dev/shm, another user):
    the put is streamed, and so is every later one."""
    payload = make_payload(2 << 20, seed=5)
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as client:
        client._staging = PutStaging(str(tmp_path))  # a folder the sidecar never looks in
        client._owns_staging = True
        assert client.put_segment(make_meta([50], payload), payload)
        assert client.put_segment(make_meta([51], payload), payload)
        assert client.counters.num_staged_puts == 0
        for tokens in ([50], [51]):
            found = client.get_segment(make_meta(tokens, payload).segment_id)
            assert found is not None and bytes(found[1]) == payload


def test_a_full_staging_folder_streams_the_put(
    sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: object, offset: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    payload = make_payload(2 << 20, seed=6)
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as client:
        assert client.put_segment(make_meta([60], payload), payload)
        assert client.counters.num_staged_puts == 0
        found = client.get_segment(make_meta([60], payload).segment_id)
        assert found is not None and bytes(found[1]) == payload


def test_the_files_of_dead_clients_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    old = time.time() - STALE_AFTER_S - 10
    files = {
        "dead-old": tmp_path / new_name(dead_pid),
        "dead-recent": tmp_path / new_name(dead_pid),
        "live-old": tmp_path / new_name(),
        "not-ours": tmp_path / f"kvsplice-staging-{dead_pid}-short",
    }
    for name, path in files.items():
        path.write_bytes(b"x")
        if name != "dead-recent":
            os.utime(path, (old, old))
    assert sweep_stale(str(tmp_path)) == 1
    assert not files["dead-old"].exists()
    assert all(files[n].exists() for n in ("dead-recent", "live-old", "not-ours"))
    assert sweep_stale("") == 0 and sweep_stale(None) == 0


def test_map_staged_refuses_what_is_not_a_staging_file(tmp_path: Path) -> None:
    from kvsplice.common.staging import StagingUnreadable

    good = tmp_path / new_name()
    good.write_bytes(b"0123456789")
    staged = map_staged(str(tmp_path), good.name, 2, 5)
    mapped = staged.buffer
    assert bytes(staged.view) == b"23456" and staged.offset == 2
    assert staged.staged is not None and staged.staged.inode == good.stat().st_ino
    mapped[:2] = b"ab"  # the room before the payload is private: the file stays as it was
    assert good.read_bytes() == b"0123456789"
    (tmp_path / (name := new_name())).mkdir()
    for args in ((good.name, 8, 5), (name, 0, 1), ("x", 0, 1), (f"../{good.name}", 0, 1)):
        with pytest.raises(StagingUnreadable):
            map_staged(str(tmp_path), *args)
    with pytest.raises(StagingUnreadable, match="no staged puts"):
        map_staged("", good.name, 0, 1)
