"""The admin HTTP API over a fake AdminSource: endpoints, auth, validation, paging, runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest
from fastapi.testclient import TestClient

from kvsplice.common.errors import InvalidRequest, StoreUnavailable
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.server.admin import MAX_PAGE_LIMIT, build_admin_app, run_admin
from kvsplice.server.admin_models import SegmentSummary
from kvsplice.server.metrics import StoreMetrics

TOKEN = "s3cret-token"
BAD_NAMESPACES = ["bad/ns", "-leading-dash", "x" * 200, "has space", ""]


def make_summary(i: int) -> SegmentSummary:
    return SegmentSummary(
        segment_id=f"{i:032x}",
        model_fingerprint="kvfp1-" + "ab" * 16,
        num_tokens=16 + i,
        start_position=32 * i,
        layer_start=0,
        layer_end=30,
        boundary_layers=(10, 20),
        payload_nbytes=4096 * (i + 1),
        created_at_s=1_700_000_000.0 + i,
        ttl_s=None if i % 2 else 3600.0,
        exact=i % 3 != 2,  # every third off the exact chain
    )


@dataclass
class FakeSource:
    ready: bool = True
    stats: dict[str, NamespaceStats] = field(default_factory=dict)
    segments: dict[str, list[SegmentSummary]] = field(default_factory=dict)
    fault: Exception | None = None

    def is_ready(self) -> bool:
        return self.ready

    def namespace_stats(self, namespace: str | None) -> dict[str, NamespaceStats]:
        if self.fault is not None:
            raise self.fault
        if namespace is None:
            return self.stats
        return {namespace: self.stats[namespace]} if namespace in self.stats else {}

    def list_segments(self, namespace: str, offset: int, limit: int) -> list[SegmentSummary]:
        return self.segments.get(namespace, [])[offset : offset + limit]


def make_source(num_segments: int = 3) -> FakeSource:
    return FakeSource(
        stats={
            "tenant-a": NamespaceStats(
                num_segments=3,
                num_bytes=12_288,
                num_hits=3,
                num_misses=1,
                num_prompt_tokens=400,
                hit_tokens={"grpc": 300},
                num_approximate_hit_tokens=100,
            ),
            "tenant-b": NamespaceStats(),
        },
        segments={"tenant-a": [make_summary(i) for i in range(num_segments)]},
    )


def make_client(
    source: FakeSource | None = None, token: str | None = None, metrics: StoreMetrics | None = None
) -> TestClient:
    metrics = metrics or StoreMetrics(rpc_methods=["Lookup", "Fetch"])
    return TestClient(build_admin_app(source or make_source(), metrics, token=token))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_healthz_answers_ok() -> None:
    response = make_client().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_follows_the_source() -> None:
    source = make_source()
    client = make_client(source)
    assert client.get("/readyz").status_code == 200
    source.ready = False
    not_ready = client.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json() == {"status": "not ready"}
    source.ready = True
    assert client.get("/readyz").status_code == 200


def test_metrics_exposes_recorded_kvsplice_series() -> None:
    metrics = StoreMetrics(rpc_methods=["Lookup"])
    metrics.record_lookup("exact", True, queried_tokens=40, hit_tokens=32)
    metrics.observe_rpc("Lookup", 0.003, "OK")
    response = make_client(metrics=metrics).get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'kvsplice_lookups_total{kind="exact",result="hit"} 1.0' in text
    assert "kvsplice_lookup_matched_tokens_total 32.0" in text
    assert 'kvsplice_rpc_duration_seconds_count{code="OK",method="Lookup"} 1.0' in text
    assert "_created" not in text


def test_stats_of_all_namespaces_and_of_one() -> None:
    client = make_client()
    everything = client.get("/v1/stats").json()["namespaces"]
    assert {row["namespace"] for row in everything} == {"tenant-a", "tenant-b"}
    (one,) = client.get("/v1/stats", params={"namespace": "tenant-a"}).json()["namespaces"]
    assert one == {
        "namespace": "tenant-a",
        "num_segments": 3,
        "stored_bytes": 12_288,
        "num_hits": 3,
        "num_misses": 1,
        "num_requested_tokens": 400,
        "num_hit_tokens": 300,
        "hit_rate": 0.75,  # the token hit rate
        "hit_tokens_by_source": {"local": 0, "in_place": 0, "grpc": 300},
        "num_approximate_hit_tokens": 100,  # of the 300: apart from the exact ones
        "num_exact_hit_tokens": 200,
        "exact_hit_rate": 0.5,
        "num_calls": 0,
        "num_evictions": 0,
        "num_refused_puts": 0,
    }


def test_hit_rate_is_null_before_the_first_lookup_and_unknown_namespace_is_empty() -> None:
    client = make_client()
    (idle,) = client.get("/v1/stats", params={"namespace": "tenant-b"}).json()["namespaces"]
    assert idle["hit_rate"] is None
    assert client.get("/v1/stats", params={"namespace": "nobody"}).json() == {"namespaces": []}


@pytest.mark.parametrize("namespace", BAD_NAMESPACES)
@pytest.mark.parametrize("path", ["/v1/stats", "/v1/segments"])
def test_bad_namespace_is_a_400_naming_it(path: str, namespace: str) -> None:
    response = make_client().get(path, params={"namespace": namespace})
    assert response.status_code == 400
    assert "namespace" in response.json()["detail"]


def test_segments_requires_a_namespace() -> None:
    assert make_client().get("/v1/segments").status_code == 422


def test_segment_listing_returns_summaries() -> None:
    page = make_client().get("/v1/segments", params={"namespace": "tenant-a"}).json()
    assert page["namespace"] == "tenant-a"
    assert page["next_offset"] is None
    first = page["segments"][0]
    assert first["segment_id"] == "0" * 32
    assert first["boundary_layers"] == [10, 20]
    assert first["layer_end"] == 30
    assert first["ttl_s"] == 3600.0
    assert [s["exact"] for s in page["segments"]] == [True, True, False]  # off-chain shown


def test_paging_visits_every_segment_exactly_once() -> None:
    source = make_source(num_segments=250)
    client = make_client(source)
    seen, offset = [], 0
    while offset is not None:
        params = {"namespace": "tenant-a", "offset": offset, "limit": 100}
        page = client.get("/v1/segments", params=params).json()
        assert len(page["segments"]) <= 100
        seen += [row["segment_id"] for row in page["segments"]]
        offset = page["next_offset"]
    assert seen == [s.segment_id for s in source.segments["tenant-a"]]


@pytest.mark.parametrize(
    ("offset", "limit", "status"),
    [(0, MAX_PAGE_LIMIT, 200), (0, MAX_PAGE_LIMIT + 1, 422), (0, 0, 422), (-1, 10, 422)],
)
def test_paging_bounds(offset: int, limit: int, status: int) -> None:
    params = {"namespace": "tenant-a", "offset": offset, "limit": limit}
    assert make_client().get("/v1/segments", params=params).status_code == status


@pytest.mark.parametrize("path", ["/metrics", "/v1/stats", "/v1/segments?namespace=tenant-a"])
def test_token_guards_metrics_and_v1(path: str) -> None:
    client = make_client(token=TOKEN)
    for headers in ({}, bearer("wrong"), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"}):
        response = client.get(path, headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.get(path, headers=bearer(TOKEN)).status_code == 200
    assert client.get(path, headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_stay_open_with_a_token(path: str) -> None:
    assert make_client(token=TOKEN).get(path).status_code == 200


def test_without_a_token_everything_is_open() -> None:
    client = make_client()
    for path in ("/metrics", "/v1/stats", "/v1/segments?namespace=tenant-a"):
        assert client.get(path).status_code == 200


@pytest.mark.parametrize("token", ["", "   "])
def test_blank_token_is_rejected(token: str) -> None:
    with pytest.raises(ValueError, match="token"):
        build_admin_app(make_source(), StoreMetrics(rpc_methods=["Lookup"]), token=token)


@pytest.mark.parametrize(
    ("fault", "status"),
    [(StoreUnavailable("lmdb not mounted"), 503), (InvalidRequest("bad filter"), 400)],
)
def test_store_faults_map_to_http_status(fault: Exception, status: int) -> None:
    source = make_source()
    source.fault = fault
    response = make_client(source).get("/v1/stats")
    assert response.status_code == status
    assert response.json()["detail"] == str(fault)


async def test_run_admin_serves_on_a_free_port_and_stops() -> None:
    app = build_admin_app(make_source(), StoreMetrics(rpc_methods=["Lookup"]))
    server = await run_admin(app, "127.0.0.1", 0)  # the kernel's pick: no window to lose it
    port = server.port
    assert port != 0 and server.running
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
    await server.stop()
    assert not server.running
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(trust_env=False) as http:
            await http.get(f"http://127.0.0.1:{port}/healthz")


async def test_run_admin_on_a_busy_port_raises_oserror() -> None:
    app = build_admin_app(make_source(), StoreMetrics(rpc_methods=["Lookup"]))
    first = await run_admin(app, "127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            await run_admin(app, "127.0.0.1", first.port)
    finally:
        await first.stop()
