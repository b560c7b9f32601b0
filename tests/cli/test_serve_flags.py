"""`kvsplice serve`'s flags are derived from the config fields: their names and variables are
a contract, and each sets its field as the hand-written mapping before them did."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.main

from kvsplice.cli import app, main
from kvsplice.index.anchor_pool import AnchorPoolConfig
from kvsplice.index.similarity_config import SimilarityConfig
from kvsplice.server.config import SegmentServiceConfig, ServerConfig
from kvsplice.storage.config import (
    LMDBTierConfig,
    MemoryTierConfig,
    RedisTierConfig,
    SessionConfig,
    StoreConfig,
)

MIB = 1 << 20
SERVE_FLAGS = (
    "listen", "admin-listen", "lmdb-path", "lmdb-map-size-mib", "lmdb-sync", "memory-mib",
    "memory-policy", "compress", "redis-url", "redis-cluster", "redis-read-replicas",
    "quota-mib", "default-ttl-s", "max-payload-mib", "max-inflight-upload-mib",
    "stream-idle-timeout-s", "chunk-mib", "auth-token", "tenants", "tls-cert", "tls-key",
    "tls-client-ca", "grace-period-s", "lsh-threshold", "lsh-num-perm", "anchor-capacity",
    "anchor-window", "log-level", "session-lease-s", "session-max-lease-s",
)  # fmt: skip
SWITCHES = ("lmdb-sync", "compress", "redis-cluster", "redis-read-replicas")


def serve_config(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """The config `kvsplice serve argv` would run (the server itself is not started)."""
    started: list[ServerConfig] = []
    monkeypatch.setattr("kvsplice.server.app.serve", started.append)
    lmdb = ["--lmdb-path", str(tmp_path / "lmdb")]
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--listen", "127.0.0.1:0", "--admin-listen", "off", *lmdb, *argv])
    assert exited.value.code == 0
    (config,) = started
    return config


def test_the_flags_and_their_variables_stay_the_contract() -> None:
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    options = {p.opts[0].removeprefix("--"): p for p in serve.params if p.opts[0] != "--help"}
    assert set(SERVE_FLAGS) <= set(options)  # none renamed or dropped; new ones may come
    for name, option in options.items():
        assert option.envvar == "KVSPLICE_" + name.upper().replace("-", "_")
        assert option.help
    assert all(options[name].secondary_opts == [f"--no-{name}"] for name in SWITCHES)


def test_defaults_make_the_config_of_the_mapping_they_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert serve_config([], tmp_path, monkeypatch) == ServerConfig(
        listen_address="127.0.0.1:0",
        store=StoreConfig(
            memory=MemoryTierConfig(max_bytes=1024 * MIB, policy="lru"),
            lmdb=LMDBTierConfig(path=str(tmp_path / "lmdb"), map_size_bytes=4096 * MIB),
        ),
        similarity=SimilarityConfig(threshold=0.6, num_perm=128),
        anchor_pool=AnchorPoolConfig(capacity=20, window=5),
        service=SegmentServiceConfig(default_ttl_s=None, max_payload_nbytes=64 * MIB),
        admin_port=None,
    )


def test_each_flag_sets_its_field_in_its_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSPLICE_AUTH_TOKEN", "")  # an empty variable is no token
    monkeypatch.setenv("KVSPLICE_REDIS_URL", "redis://10.0.0.1:6379/0")
    argv = [
        "--memory-mib", "0", "--lmdb-map-size-mib", "8", "--no-lmdb-sync", "--compress",
        "--redis-cluster", "--quota-mib", "2", "--default-ttl-s", "60", "--max-payload-mib", "1",
        "--max-inflight-upload-mib", "3", "--chunk-mib", "1", "--lsh-threshold", "0.5",
        "--anchor-window", "2", "--grace-period-s", "0", "--memory-policy", "LFU",
    ]  # fmt: skip
    config = serve_config(argv, tmp_path, monkeypatch)
    assert config.store == StoreConfig(
        memory=None,
        lmdb=LMDBTierConfig(str(tmp_path / "lmdb"), 8 * MIB, compress=True, sync=False),
        redis=RedisTierConfig(url="redis://10.0.0.1:6379/0", cluster=True),
        default_quota_bytes=2 * MIB,
    )
    assert config.auth_token is None and config.tls is None and config.tenants_path is None
    assert (config.service.default_ttl_s, config.service.max_payload_nbytes) == (60.0, MIB)
    assert (config.max_inflight_upload_nbytes, config.chunk_nbytes) == (3 * MIB, MIB)
    assert (config.similarity.threshold, config.anchor_pool.window) == (0.5, 2)
    assert config.grace_period_s == 0


def test_a_memory_policy_is_kept_when_the_memory_tier_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = serve_config(["--memory-policy", "LFU"], tmp_path, monkeypatch)
    assert config.store.memory == MemoryTierConfig(max_bytes=1024 * MIB, policy="lfu")
    assert type(config.store.memory.policy) is str


def test_the_session_flags_set_the_store_s_session_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--session-lease-s", "45", "--session-max-lease-s", "90"]
    config = serve_config(argv, tmp_path, monkeypatch)
    assert config.store.sessions == SessionConfig(lease_s=45.0, max_lease_s=90.0)
    assert serve_config([], tmp_path, monkeypatch).store.sessions == SessionConfig()
