"""The shared tier's publish queue while Redis is unreachable: bounded, latest op per key."""

from __future__ import annotations

import socket

from kvsplice.storage.config import RedisTierConfig
from kvsplice.storage.shared_tier import SharedTier


def unreachable_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"  # nothing listens once the socket closes


def test_writes_wait_while_degraded_and_the_oldest_are_dropped_past_the_bound() -> None:
    config = RedisTierConfig(url=unreachable_url(), max_pending_publish=3, probe_interval_s=5.0)
    shared = SharedTier(config)
    try:
        status = shared.status()
        assert status.degraded and status.num_pending == 0
        for i in range(3):
            shared.publish_put(b"k%d" % i)
        shared.publish_removal(b"k0", "delete")  # replaces k0's put, moves it last
        assert shared.status().num_pending == 3 and shared.status().num_unshared == 0
        shared.publish_put(b"k3")
        shared.publish_blob(b"k4")
        status = shared.status()
        assert status.num_pending == 3 and status.num_unshared == 2
        assert list(shared._pending) == [b"k0", b"k3", b"k4"]  # k1, k2 dropped: oldest first
        assert shared._pending[b"k0"] == ("remove", "delete")
        assert not shared.wait_published(0.05)
    finally:
        shared.close()
