"""The connector's extra-config keys: parsed once, validated with the bad value named."""

from __future__ import annotations

import pytest

from kvsplice.integrations.vllm.connector_config import ConnectorConfig, salted_namespace


def test_the_contract_keys_are_read() -> None:
    config = ConnectorConfig.from_extra_config(
        {"target": "unix:/run/k.sock", "namespace": "team-a", "token": "t", "tls_ca": "/ca.pem",
         "chunk_tokens": "256", "same_host_reads": "false", "staged_puts": "no"}
    )  # fmt: skip
    assert (config.target, config.namespace, config.token, config.tls_ca) == (
        "unix:/run/k.sock", "team-a", "t", "/ca.pem",
    )  # fmt: skip
    assert config.chunk_tokens == 256 and config.same_host_reads is False
    assert config.staged_puts is False
    assert config.quant == "none"  # lossless unless asked: only exact KV enters the engine


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "target"),
        ({"target": "h:1", "namespce": "x"}, "namespce"),
        ({"target": "h:1", "namespace": "bad name"}, "namespace"),
        ({"target": "h:1", "quant": "fp4"}, "fp4"),
        ({"target": "h:1", "chunk_tokens": 0}, "chunk_tokens"),
        ({"target": "h:1", "same_host_reads": "perhaps"}, "perhaps"),
    ],
)
def test_bad_keys_are_a_value_error_naming_them(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_chunks_fall_on_block_edges() -> None:
    default = ConnectorConfig("h:1")  # 256 tokens, rounded up to whole blocks
    assert [default.chunk_tokens_for(b) for b in (16, 128, 96, 512)] == [256, 256, 288, 512]
    assert ConnectorConfig("h:1", chunk_tokens=128).chunk_tokens_for(128) == 128
    assert ConnectorConfig("h:1", chunk_tokens=256).chunk_tokens_for(128) == 256
    with pytest.raises(ValueError, match="multiple of the block size"):
        ConnectorConfig("h:1", chunk_tokens=200).chunk_tokens_for(128)


def test_decode_written_kv_is_stored_by_default_only_in_float32() -> None:
    default = ConnectorConfig("h:1")
    assert [default.save_decode_for(d) for d in ("float32", "bfloat16", "float16")] == [
        True, False, False,
    ]  # fmt: skip
    for value, expected in (("false", False), ("true", True)):
        explicit = ConnectorConfig.from_extra_config({"target": "h:1", "save_decode": value})
        assert {explicit.save_decode_for(d) for d in ("float32", "bfloat16")} == {expected}


def test_a_cache_salt_gives_its_own_namespace() -> None:
    assert salted_namespace("team-a", None) == "team-a"
    salted = {salted_namespace("team-a", salt) for salt in ("s1", "s2", "a secret with spaces")}
    assert len(salted) == 3
    assert all(ns.startswith("team-a.salt-") for ns in salted)
    assert salted_namespace("team-a", "s1") == salted_namespace("team-a", "s1")
    long = salted_namespace("n" * 128, "s1")  # still a valid namespace
    assert len(long) <= 128


def test_load_async_is_auto_by_default_and_takes_a_boolean_for_always_or_never() -> None:
    assert ConnectorConfig("h:1").load_async == "auto"
    for value, expected in ((True, "always"), (False, "never"), ("never", "never")):
        extra = {"target": "h:1", "load_async": value}
        assert ConnectorConfig.from_extra_config(extra).load_async == expected
    with pytest.raises(ValueError, match="load_async"):
        ConnectorConfig("h:1", load_async="sometimes")
