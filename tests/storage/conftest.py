"""Factories and tier fixtures shared by the storage tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import redis
from helpers.store import make_meta

from kvsplice.common.segment import SegmentMeta

FINGERPRINT = "kvfp1-" + "ab" * 16
REDIS_URL = "redis://127.0.0.1:6379/0"


def _make_payload(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _make_segment(
    namespace: str = "tenant-a",
    token_ids: Sequence[int] = (1, 2, 3),
    nbytes: int = 1024,
    seed: int = 0,
    ttl_s: float | None = None,
    created_at_s: float = 1000.0,
) -> tuple[SegmentMeta, bytes]:
    """A valid (meta, payload) pair whose payload is `nbytes` seeded random bytes."""
    payload = _make_payload(nbytes, seed)
    meta = make_meta(
        token_ids, payload, namespace=namespace, fingerprint=FINGERPRINT,
        layer_end=4, boundary_layers=(2,), ttl_s=ttl_s, created_at_s=created_at_s,
        left_tail_ids=(7, 8), index_text="some text", labels=(("agent", "critic"),),
    )  # fmt: skip
    return meta, payload


@pytest.fixture(scope="session")
def make_payload() -> Callable[..., bytes]:
    return _make_payload


@pytest.fixture(scope="session")
def make_segment() -> Callable[..., tuple[SegmentMeta, bytes]]:
    return _make_segment


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    """A client of the loopback Redis, or a skip saying why there is none."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5, socket_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.skip(f"no Redis at 127.0.0.1:6379 ({exc})")
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted afterwards."""
    prefix = f"kvsplice-test:{uuid.uuid4().hex}:"
    yield prefix
    names = list(redis_client.scan_iter(match=prefix.encode() + b"*", count=1000))
    if names:
        redis_client.delete(*names)
