"""ServerConfig / SegmentServiceConfig: every bad value is refused with a message naming it."""

from __future__ import annotations

import pytest

from kvsplice.server.config import SegmentServiceConfig, ServerConfig


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:50051", "localhost:0", "[::1]:50051", "unix:/tmp/kv.sock", "unix:///run/kv.sock"],
)
def test_accepted_listen_addresses(address: str) -> None:
    assert ServerConfig(listen_address=address).listen_address == address


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"listen_address": "50051"}, "listen_address"),
        ({"listen_address": "unix:"}, "listen_address"),
        ({"auth_token": ""}, "auth_token"),
        ({"auth_token": "bad\ntoken"}, "auth_token"),
        ({"chunk_nbytes": 1024}, "chunk_nbytes"),
        ({"grace_period_s": -1.0}, "grace_period_s"),
        ({"sweep_interval_s": 0.0}, "sweep_interval_s"),
        ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs"),
        ({"admin_port": 70000}, "admin_port"),
    ],
)
def test_bad_server_configs_name_the_bad_value(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ServerConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_payload_nbytes": 0}, "max_payload_nbytes"),
        ({"max_segment_tokens": 2**21}, "max_segment_tokens"),
        ({"default_similar_limit": 9, "max_similar_limit": 8}, "default_similar_limit"),
        ({"default_ttl_s": 0.0}, "default_ttl_s"),
        ({"default_ttl_s": float("inf")}, "default_ttl_s"),
        ({"max_labels": -1}, "max_labels"),
    ],
)
def test_bad_service_configs_name_the_bad_value(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SegmentServiceConfig(**fields)


def test_message_limit_is_one_chunk_plus_slack_never_unlimited() -> None:
    config = ServerConfig(chunk_nbytes=4 << 20)
    assert 4 << 20 < config.max_message_nbytes <= 6 << 20
