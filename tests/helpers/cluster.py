"""`make_*` factories and probes for the shared-tier tests (segments, clients, readiness)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.store import make_meta
from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.server.embedded import EmbeddedStore
from kvsplice.storage.config import RedisTierConfig
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

FINGERPRINT = "kvfp1-" + "c" * 32
NAMESPACE = "tenant-shared"


def shared_config(url: str, key_prefix: str, cluster: bool = True) -> RedisTierConfig:
    return RedisTierConfig(
        url=url, cluster=cluster, key_prefix=key_prefix, socket_timeout_s=0.25, probe_interval_s=0.2
    )


def make_chain(
    num_segments: int, tokens_per_segment: int = 16, nbytes: int = 16 * 1024, seed: int = 0
) -> list[tuple[SegmentMeta, bytes]]:
    """Consecutive segments from position 0 with seeded tokens and payloads."""
    rng = random.Random(seed)
    chain, parent, position = [], root_key(FINGERPRINT), 0
    for _ in range(num_segments):
        tokens = tuple(rng.randrange(1, 50_000) for _ in range(tokens_per_segment))
        payload = rng.randbytes(nbytes)
        meta = make_meta(
            tokens, payload, parent_key=parent, start_position=position,
            namespace=NAMESPACE, fingerprint=FINGERPRINT, layer_end=4,
        )  # fmt: skip
        chain.append((meta, payload))
        parent, position = meta.context_key, position + tokens_per_segment
    return chain


def chain_tokens(chain: Sequence[tuple[SegmentMeta, bytes]]) -> list[int]:
    return [t for meta, _ in chain for t in meta.token_ids]


def make_client(sidecar: EmbeddedStore) -> StoreClient:
    config = StoreClientConfig(lookup_timeout_s=2.0, get_timeout_s=5.0, put_timeout_s=5.0)
    return StoreClient(sidecar.target, NAMESPACE, config=config)


def readyz(sidecar: EmbeddedStore) -> tuple[int, dict]:
    admin = sidecar.server.admin
    assert admin is not None
    reply = httpx.get(f"http://127.0.0.1:{admin.port}/readyz", timeout=2.0)
    return reply.status_code, reply.json()


def health_status(sidecar: EmbeddedStore) -> str:
    with grpc.insecure_channel(sidecar.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2.0
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def metric(sidecar: EmbeddedStore, name: str) -> float:
    """The value of an unlabelled series on the sidecar's `/metrics`."""
    admin = sidecar.server.admin
    assert admin is not None
    text = httpx.get(f"http://127.0.0.1:{admin.port}/metrics", timeout=2.0).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
