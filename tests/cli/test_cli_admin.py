"""`kvsplice stats`, `ls`, `delete` and `flush` against a live embedded sidecar."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsplice.cli import main
from kvsplice.common.keys import root_key
from kvsplice.common.reuse_report import ReusedRun
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.results import PrefixLookup
from kvsplice.storeclient.wire import with_payload_digest

FINGERPRINT = "kvfp1-" + "0" * 32
NAMESPACE = "tenant-a"


def make_meta(tokens: tuple[int, ...], payload: bytes, exact: bool = True) -> SegmentMeta:
    root = root_key(FINGERPRINT)
    meta = chained_meta(NAMESPACE, FINGERPRINT, root, tokens, 0, 30, exact=exact)
    return with_payload_digest(meta, payload)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[EmbeddedStore]:
    config = loopback_config(str(tmp_path), admin_port=0)
    with EmbeddedStore(config) as store:
        with StoreClient(store.target, NAMESPACE) as client:
            for i in range(3):
                payload = random.Random(i).randbytes(3000)
                meta = make_meta((i, i + 1, i + 2, i + 3), payload, exact=i != 2)  # 2: off-chain
                assert client.put_segment(meta, payload)
            # a worker's call of 8 prompt tokens reused 4 (2 approximate): a hit rate of 50%.
            assert client.lookup_prefix(FINGERPRINT, [0, 1, 2, 3, 9, 9, 9, 9]) != PrefixLookup.MISS
            runs = [ReusedRun(1, "in_place"), ReusedRun(2, "in_place", exact=False)]
            client.report_reuse(8, [*runs, ReusedRun(1, "grpc")])
        yield store


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def test_stats_json_and_table(sidecar: EmbeddedStore, capsys: pytest.CaptureFixture[str]) -> None:
    url = ["--admin-url", str(sidecar.admin_url)]
    code, out, _ = run_cli(["stats", "--json", *url], capsys)
    (row,) = json.loads(out)["namespaces"]
    assert code == 0
    assert (row["num_segments"], row["stored_bytes"] > 9000) == (3, True)
    assert (row["num_requested_tokens"], row["num_hit_tokens"], row["hit_rate"]) == (8, 4, 0.5)
    assert (row["num_approximate_hit_tokens"], row["num_exact_hit_tokens"]) == (2, 2)
    code, out, _ = run_cli(["stats", *url], capsys)
    assert code == 0 and "50.0%" in out and "KiB" in out and "4/8" in out
    (line,) = [ln for ln in out.splitlines() if NAMESPACE in ln]
    assert re.search(r"0 / 3 / 1\W+2\W*$", line), out  # local / in place / gRPC, approximate


def test_ls_delete_and_flush(sidecar: EmbeddedStore, capsys: pytest.CaptureFixture[str]) -> None:
    url = ["--admin-url", str(sidecar.admin_url)]
    _, out, _ = run_cli(["ls", "-n", NAMESPACE, "--json", *url], capsys)
    ids = [seg["segment_id"] for seg in json.loads(out)["segments"]]
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    _, table, _ = run_cli(["ls", "-n", NAMESPACE, *url], capsys)
    assert ids[0] in table and "2.9 KiB" in table  # whole ids, human sizes
    marks = {seg["segment_id"]: seg["exact"] for seg in json.loads(out)["segments"]}
    for segment_id, exact in marks.items():
        (line,) = [ln for ln in table.splitlines() if segment_id in ln]
        assert ("off-chain" in line) == (not exact) and ("exact" in line) == exact
    assert sorted(marks.values()) == [False, True, True]

    code, out, _ = run_cli(["delete", ids[0], "-n", NAMESPACE, *url], capsys)
    assert code == 0 and out.strip() == f"deleted {ids[0]}"
    code, _, err = run_cli(["delete", ids[0], "-n", NAMESPACE, *url], capsys)
    assert code == 1 and "is not stored" in err
    code, _, err = run_cli(["delete", "xyz", "-n", NAMESPACE, *url], capsys)
    assert code == 1 and "HTTP 400" in err and len(err.strip().splitlines()) == 1

    code, out, _ = run_cli(["flush", "-n", NAMESPACE, "--yes", *url], capsys)
    assert code == 0 and out.startswith(f"flushed {NAMESPACE}: 2 segments, 5.9 KiB freed")
    _, out, _ = run_cli(["ls", "-n", NAMESPACE, "--json", *url], capsys)
    assert json.loads(out)["segments"] == []
