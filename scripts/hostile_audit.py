"""A hostile operator's audit of `kvsplice serve`, run against real sidecar processes.

    python scripts/hostile_audit.py [--requests 10000] [--out results/hostile_audit.json]

Measures what issue 16 asks to show: (1) two tenants, every RPC and admin endpoint aimed
at the other's namespace; (2) N malformed requests across every RPC (statuses, tracebacks,
log growth, data intact); (3) a stalled upload against the default idle timeout; (4) NaN/inf
TTLs and expiry; stalled 64 MiB uploads and a 64 MiB put beside health checks; (5) a full LMDB shared by two tenants; (6) SIGKILL mid-load and restart.
Prints one summary line per check and writes the figures as JSON. The sidecar under audit
is `hostile_sidecar`'s, the hostile requests `hostile_requests`'.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hostile_requests import cross_tenant_calls, malformed, send_raw, valid_messages
from hostile_sidecar import (
    CHANNEL_OPTIONS,
    TOKENS,
    Sidecar,
    bearer,
    code_of,
    free_port,
    read_payload,
    rss_mib,
    segment,
)

from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.servicer import RPC_METHODS
from kvsplice.server.tenants import token_sha256
from kvsplice.storeclient.wire import meta_to_header, put_requests

# -- 1. two tenants -------------------------------------------------------------------


def audit_tenants(workdir: Path) -> dict[str, Any]:
    tenants_file = workdir / "tenants.json"
    entries = [
        {"name": ns, "token_sha256": token_sha256(token), "namespaces": [ns], "role": "writer"}
        for ns, token in TOKENS.items()
    ]
    tenants_file.write_text(json.dumps({"tenants": entries}))
    sidecar = Sidecar(
        workdir, "--lmdb-path", str(workdir / "lmdb-tenants"), "--tenants", str(tenants_file)
    )
    try:
        with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            payload = random.Random(1).randbytes(100_000)
            victim = segment("team-b", (11, 12, 13), payload)
            stub.PutSegment(put_requests(victim, payload, 65536), metadata=bearer("team-b"))
            own_payload = random.Random(2).randbytes(1000)
            own = segment("team-a", (14,), own_payload)
            stub.PutSegment(put_requests(own, own_payload, 65536), metadata=bearer("team-a"))
            rpc_codes = {
                name: code_of(lambda c=call: c(bearer("team-a"))).name  # type: ignore[misc]
                for name, call in cross_tenant_calls(stub, victim).items()
            }
            no_token = {
                name: code_of(lambda c=call: c(())).name  # type: ignore[misc]
                for name, call in cross_tenant_calls(stub, victim).items()
            }
            intact = read_payload(stub, victim) == payload
        base = f"http://127.0.0.1:{sidecar.admin_port}"
        admin_paths = ["/v1/stats?namespace=team-b", "/v1/segments?namespace=team-b", "/metrics"]
        headers_a = dict(bearer("team-a"))
        admin_codes = {
            p: httpx.get(base + p, headers=headers_a, timeout=10).status_code for p in admin_paths
        }
        admin_codes["/openapi.json (no token)"] = httpx.get(
            base + "/openapi.json", timeout=10
        ).status_code
        listed = [
            r["namespace"]
            for r in httpx.get(base + "/v1/stats", headers=headers_a, timeout=10).json()[
                "namespaces"
            ]
        ]
    finally:
        sidecar.stop()
    text = tenants_file.read_text()
    return {
        "rpc_status_aimed_at_team_b_with_team_a_token": rpc_codes,
        "rpc_status_without_token": no_token,
        "admin_status_aimed_at_team_b_with_team_a_token": admin_codes,
        "v1_stats_namespaces_seen_by_team_a": listed,
        "team_b_segment_intact": intact,
        "tokens_in_tenants_file": sum(token in text for token in TOKENS.values()),
    }  # fmt: skip


# -- 2. malformed requests ---------------------------------------------------------------


def audit_malformed(workdir: Path, num_requests: int) -> dict[str, Any]:
    sidecar = Sidecar(workdir, "--lmdb-path", str(workdir / "lmdb-fuzz"), admin=False)
    rng = random.Random(16)
    codes: Counter[str] = Counter()
    try:
        with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            kept_payload = rng.randbytes(200_000)
            kept = segment("team-a", (21, 22, 23), kept_payload)
            stub.PutSegment(put_requests(kept, kept_payload, 65536))
            log_before = sidecar.log_path.stat().st_size
            probe_payload = rng.randbytes(1000)
            probe = segment("team-a", (31, 32), probe_payload, ttl_s=3600.0)
            valid = valid_messages(probe, probe_payload)
            started = time.monotonic()
            for i in range(num_requests):
                method = RPC_METHODS[i % len(RPC_METHODS)]
                frames = malformed(rng, method, valid[method], probe)
                codes[send_raw(channel, method, frames, ()).name] += 1
            elapsed_s = time.monotonic() - started
            intact = read_payload(stub, kept) == kept_payload
            serving = sidecar.is_serving()
        log_growth = sidecar.log_path.stat().st_size - log_before
        text = sidecar.log_text()
    finally:
        sidecar.stop()
    return {
        "requests": num_requests,
        "seconds": round(elapsed_s, 1),
        "status_counts": dict(codes.most_common()),
        "unknown_or_internal": codes["UNKNOWN"] + codes["INTERNAL"],
        "tracebacks_in_log": text.count("Traceback"),
        "error_lines_in_log": sum(" ERROR " in line for line in text.splitlines()),
        "log_growth_bytes": log_growth,
        "server_serving_after": serving,
        "kept_segment_intact": intact,
    }


# -- 3. stalled upload, 4. TTLs -----------------------------------------------------------


def stalled(meta: SegmentMeta, release: threading.Event) -> Iterator[pb.PutSegmentRequest]:
    yield pb.PutSegmentRequest(header=meta_to_header(meta))
    yield pb.PutSegmentRequest(chunk=b"\0" * (1 << 20))
    release.wait(120)


def audit_stall_and_ttl(workdir: Path) -> dict[str, Any]:
    sidecar = Sidecar(workdir, "--lmdb-path", str(workdir / "lmdb-stall"), admin=False)
    release = threading.Event()
    try:
        with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            big = segment("team-a", (41,), b"\0" * (60 << 20))
            started = time.monotonic()
            code = code_of(lambda: stub.PutSegment(stalled(big, release), timeout=120))
            cut_after_s = time.monotonic() - started
            release.set()
            payload = b"ttl" * 100
            ttl_codes = {}
            for ttl in (math.nan, math.inf, -math.inf, -1.0):
                header = meta_to_header(segment("team-a", (51,), payload))
                header.ttl_s = ttl
                frames = [pb.PutSegmentRequest(header=header), pb.PutSegmentRequest(chunk=payload)]
                ttl_codes[repr(ttl)] = code_of(
                    lambda f=frames: stub.PutSegment(iter(f), timeout=10)
                ).name  # type: ignore[misc]
            short = segment("team-a", (52,), payload, ttl_s=1.0)
            stub.PutSegment(put_requests(short, payload, 4096), timeout=10)
            present_before = read_payload(stub, short) == payload
            time.sleep(2.5)
            expired = read_payload(stub, short) is None
    finally:
        sidecar.stop()
    return {
        "stalled_upload_status": code.name,
        "stalled_upload_cut_after_s": round(cut_after_s, 2),
        "ttl_status": ttl_codes,
        "ttl_1s_segment_present_then_expired": present_before and expired,
    }


def audit_exhaustion(workdir: Path) -> dict[str, Any]:
    """A 64 MiB put and get while health checks run; then 8 uploads declaring 64 MiB that
    send 60 MiB and stall."""
    sidecar = Sidecar(workdir, "--lmdb-path", str(workdir / "lmdb-exhaust"), admin=False)
    release = threading.Event()
    codes: list[str] = []
    peak_rss = 0.0
    try:
        rss_start = rss_mib(sidecar.process.pid)

        payload = random.Random(9).randbytes(64 << 20)
        meta = segment("team-a", (71,), payload)
        latencies: list[float] = []
        done = threading.Event()

        def probe() -> None:
            with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while not done.is_set():
                    t0 = time.perf_counter()
                    health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            t0 = time.perf_counter()
            stub.PutSegment(put_requests(meta, payload, 4 << 20), timeout=120)
            put_s = time.perf_counter() - t0
            get_ok = read_payload(stub, meta) == payload
        done.set()
        prober.join()
        rss_after_put = rss_mib(sidecar.process.pid)

        def upload(i: int) -> None:
            meta = segment("team-a", (61, i + 1), b"\0" * (64 << 20))

            def frames() -> Iterator[pb.PutSegmentRequest]:
                yield pb.PutSegmentRequest(header=meta_to_header(meta))
                for _ in range(15):
                    yield pb.PutSegmentRequest(chunk=b"\1" * (4 << 20))
                release.wait(120)

            with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
                stub = store_pb2_grpc.SegmentStoreStub(channel)
                codes.append(code_of(lambda: stub.PutSegment(frames(), timeout=120)).name)

        started = time.monotonic()
        uploads = [threading.Thread(target=upload, args=(i,)) for i in range(8)]
        # NOTE: 8 x 64 MiB declared > the 256 MiB budget: four are refused at once.
        for thread in uploads:
            thread.start()
        while any(t.is_alive() for t in uploads) and time.monotonic() - started < 60:
            peak_rss = max(peak_rss, rss_mib(sidecar.process.pid))
            time.sleep(0.2)
        all_cut_s = time.monotonic() - started
        release.set()
        for thread in uploads:
            thread.join(30)
    finally:
        sidecar.stop()
    return {
        "stalled_64mib_uploads": Counter(codes),
        "all_stalled_uploads_ended_after_s": round(all_cut_s, 1),
        "rss_mib_start_peak": [round(rss_start), round(peak_rss)],
        "put_64mib_s": round(put_s, 2),
        "get_64mib_ok": get_ok,
        "health_checks_during_put_and_get": len(latencies),
        "health_max_ms_during_put_and_get": round(1e3 * max(latencies), 1),
        "rss_mib_after_64mib_put": round(rss_after_put),
    }


# -- 5. full LMDB, two tenants -------------------------------------------------------------


def audit_full_lmdb(workdir: Path) -> dict[str, Any]:
    flags = [
        "--lmdb-path",
        str(workdir / "lmdb-full"),
        "--lmdb-map-size-mib",
        "16",
        "--memory-mib",
        "0",
    ]
    sidecar = Sidecar(workdir, *flags)
    seg_nbytes = 256 * 1024
    rng = random.Random(5)
    try:
        with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)

            def put(namespace: str, i: int) -> SegmentMeta:
                payload = rng.randbytes(seg_nbytes)
                meta = segment(namespace, (1000 + i,), payload)
                stub.PutSegment(put_requests(meta, payload, 65536), timeout=30)
                return meta

            old = [put("old", i) for i in range(40)]  # ~10 MiB: most of the map
            new = [put("new", i) for i in range(120)]  # keeps writing
        base = f"http://127.0.0.1:{sidecar.admin_port}"
        stats = {
            r["namespace"]: r["num_segments"]
            for r in httpx.get(base + "/v1/stats", timeout=10).json()["namespaces"]
        }
        kept_ids = {
            ns: {
                seg["segment_id"]
                for seg in httpx.get(
                    base + "/v1/segments", params={"namespace": ns, "limit": 1000}, timeout=10
                ).json()["segments"]
            }
            for ns in ("old", "new")
        }
        metrics = httpx.get(base + "/metrics", timeout=10).text
    finally:
        sidecar.stop()
    evictions = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvsplice_namespace_evictions_total")
    ]
    return {
        "segments_written": {"old": len(old), "new": len(new)},
        "segments_kept": stats,
        # Per tenant, the kept segments are its newest: the oldest went first.
        "kept_are_each_tenants_newest": all(
            held == sorted(held)
            for held in (
                [m.segment_id in kept_ids[ns] for m in metas] for ns, metas in (("old", old), ("new", new))
            )
        ),
        "eviction_series": evictions,
        "segment_payload_bytes": seg_nbytes,
    }  # fmt: skip


# -- 6. SIGKILL mid-load -------------------------------------------------------------------


def audit_sigkill(workdir: Path, rounds: int = 3) -> dict[str, Any]:
    lmdb = workdir / "lmdb-crash"
    port = free_port()
    acked: list[tuple[SegmentMeta, bytes]] = []
    for round_ in range(rounds):
        sidecar = Sidecar(
            workdir, "--lmdb-path", str(lmdb), "--memory-mib", "0", admin=False, port=port
        )
        stop = threading.Event()

        def load(r: int = round_, stop: threading.Event = stop) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
                stub = store_pb2_grpc.SegmentStoreStub(channel)
                for i in range(100_000):
                    if stop.is_set():
                        return
                    payload = random.Random(r * 100_000 + i).randbytes(300_000)
                    meta = segment("team-a", (r + 1, i + 1), payload)
                    try:
                        stub.PutSegment(put_requests(meta, payload, 65536), timeout=10)
                    except grpc.RpcError:
                        return
                    acked.append((meta, payload))

        writer = threading.Thread(target=load)
        writer.start()
        time.sleep(1.5)
        sidecar.stop(signal.SIGKILL)
        stop.set()
        writer.join(30)
    sidecar = Sidecar(workdir, "--lmdb-path", str(lmdb), admin=False, port=port)
    lost = corrupt = 0
    try:
        with grpc.insecure_channel(sidecar.target, options=CHANNEL_OPTIONS) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            for meta, payload in acked:
                got = read_payload(stub, meta)
                lost += got is None
                corrupt += got is not None and got != payload
    finally:
        sidecar.stop()
    return {"sigkills": rounds, "acked_puts": len(acked), "lost": lost, "corrupt_served": corrupt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=Path("results/hostile_audit.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvsplice-audit-") as tmp:
        workdir = Path(tmp)
        report = {
            "tenants": audit_tenants(workdir),
            "malformed": audit_malformed(workdir, args.requests),
            "stall_and_ttl": audit_stall_and_ttl(workdir),
            "exhaustion": audit_exhaustion(workdir),
            "full_lmdb": audit_full_lmdb(workdir),
            "sigkill": audit_sigkill(workdir),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for section, figures in report.items():
        print(f"{section}: {json.dumps(figures)}")


if __name__ == "__main__":
    main()
