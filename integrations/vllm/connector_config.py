"""The connector's settings: `kv_connector_extra_config` read once into a frozen config.

Keys (a contract): `target` (sidecar `host:port` or `unix:` path), `namespace`,
`token`, `tls_ca`, `chunk_tokens`; and `quant`, `same_host_reads`, `staged_puts`, `save_decode`,
`save_tails`,
`lookup_timeout_ms`, `max_pending_saves`, `lookup_wait_ms`, `lookup_deadline_ms`,
`token_env`, `token_file`, `tls_cert`, `tls_key`, `load_async`, `reuse_policy`,
`negative_control`. Knows nothing
of vLLM's objects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvsplice.common.segment import validate_namespace
from kvsplice.integrations.vllm.negative_controls import NEGATIVE_CONTROLS

# Only lossless payloads by default: KV that enters an engine's prefix cache must be
# what the engine would have computed. int8 halves the bytes and is an approximation.
QUANTS = ("none", "int8")
# NOTE: LMCache's default too. One chunk is one stored segment and one read: at 16-token
# CUDA blocks, one block per chunk meant 2,048 reads for a 32k-token hit.
DEFAULT_CHUNK_TOKENS = 256
LOAD_ASYNC = ("auto", "always", "never")


@dataclass(frozen=True)
class ConnectorConfig:
    """Where the sidecar is and how to use it.

    `chunk_tokens` (None: 256 tokens, rounded up to whole blocks) cuts the key chain; it
    must be a multiple of the block size so chunk edges fall on block edges. A prompt's
    tail shorter than a chunk is not stored. `namespace` is
    the tenant's; a request's `cache_salt` is mixed into it (`salted_namespace`).
    `save_decode` also stores K/V written while decoding (see `save_chain.SaveRules`);
    None (the default) means: only where the engine keeps K/V in float32
    (`save_decode_for`). `save_tails` also stores each request's last half chunk (whole
    blocks) once computed, so the next request of a transcript finds up to half a chunk
    more (`SaveChain._tail`); the full chunk is stored when it fills.
    `max_pending_saves` bounds chunks waiting for the background putter: past it a
    chunk is dropped (counted, logged), never waited for.
    Lookups run off the scheduler loop: the new requests of a step wait for their lookups
    at most `lookup_wait_ms` together (one budget per step), are asked about again in later
    steps, and are served without the sidecar once `lookup_deadline_ms` passed with no answer
    (`lookup_timeout_ms` is one RPC's deadline, retries included).
    The tenant's token: `token` (it then shows in vLLM's logged config), or better
    `token_env` (the name of an environment variable) or `token_file` (a path).
    `tls_cert` and `tls_key` present a client certificate (a sidecar with mTLS).
    `load_async`: "always" — a request whose prefix is loaded waits while the load runs
    beside the engine's steps (vLLM's `load_kv_async`), so it never stalls the running
    requests' forward; "never" — loads run in the step, before the forward pass; "auto"
    (the default) — beside the steps when other requests are running, in the step when the
    engine has nothing else to do (then waiting for a background load only adds steps;
    on CPU the loader thread also competes with the engine's spinning threads: agent 5 of
    `bench vllm` took 1.19 s async against 0.97 s in the step). true/false mean always/never.
    `reuse_policy`: the admission policy JSON (`kvsplice bench vllm-graded --admit` writes
    an engine's, from graded answers) that decides whether a
    request asking for `{"kvsplice": {"reuse": "gated"}}` gets approximate runs: only
    when it admits `naive` for this model (None: the policy shipped for the model, else
    the safe default, which admits none: such requests then get exact reuse).
    `negative_control` ("unrotated" or "noise"; None by default): the graded yardstick's
    deliberately damaged approximate K/V (`negative_controls`), for benches only.
    """

    target: str
    namespace: str = "default"
    token: str | None = None
    tls_ca: str | None = None
    chunk_tokens: int | None = None
    quant: str = "none"
    same_host_reads: bool = True
    staged_puts: bool = True
    save_decode: bool | None = None
    save_tails: bool = True
    lookup_timeout_ms: int = 500
    max_pending_saves: int = 256
    lookup_wait_ms: int = 20
    lookup_deadline_ms: int = 2000
    token_env: str | None = None
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    load_async: str = "auto"
    reuse_policy: str | None = None
    negative_control: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(
                "kv_connector_extra_config['target'] (host:port or unix:path) is required"
            )
        validate_namespace(self.namespace)
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be >= 1")
        if self.quant not in QUANTS:
            raise ValueError(f"quant {self.quant!r} not in {QUANTS}")
        if not 1 <= self.lookup_timeout_ms <= 60_000:
            raise ValueError(f"lookup_timeout_ms {self.lookup_timeout_ms} not in [1, 60000]")
        if self.max_pending_saves < 1:
            raise ValueError(f"max_pending_saves {self.max_pending_saves} must be >= 1")
        if not 0 <= self.lookup_wait_ms <= self.lookup_deadline_ms <= 600_000:
            raise ValueError(
                f"need 0 <= lookup_wait_ms ({self.lookup_wait_ms}) <= lookup_deadline_ms "
                f"({self.lookup_deadline_ms}) <= 600000"
            )
        if sum(x is not None for x in (self.token, self.token_env, self.token_file)) > 1:
            raise ValueError("give the token one way: token, token_env or token_file")
        if self.load_async not in LOAD_ASYNC:
            raise ValueError(f"load_async {self.load_async!r} not in {LOAD_ASYNC}")
        if self.negative_control is not None and self.negative_control not in NEGATIVE_CONTROLS:
            raise ValueError(
                f"negative_control {self.negative_control!r} not in {NEGATIVE_CONTROLS}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (a client certificate)")

    def resolved_token(self) -> str | None:
        """The tenant's token from wherever it was given; ValueError naming a missing source."""
        if self.token_env is not None:
            token = os.environ.get(self.token_env)
            if not token:
                raise ValueError(f"token_env {self.token_env!r}: that variable is not set")
            return token
        if self.token_file is not None:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as error:
                raise ValueError(f"token_file {self.token_file!r}: {error.strerror}") from None
            if not token:
                raise ValueError(f"token_file {self.token_file!r} is empty")
            return token
        return self.token

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Read vLLM's `kv_connector_extra_config`; unknown keys are a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        if not extra.get("target"):
            raise ValueError(
                "kv_connector_extra_config['target'] (the sidecar's host:port or unix:path) is required"
            )
        values = dict(extra)
        for name in (
            "chunk_tokens", "lookup_timeout_ms", "max_pending_saves", "lookup_wait_ms",
            "lookup_deadline_ms",
        ):  # fmt: skip
            if values.get(name) is not None:
                values[name] = int(values[name])
        for name in ("same_host_reads", "staged_puts", "save_decode", "save_tails"):
            if name in values:
                values[name] = _as_bool(values[name])
        if isinstance(values.get("load_async"), bool):
            values["load_async"] = "always" if values["load_async"] else "never"
        return cls(**values)

    def save_decode_for(self, kv_dtype: str) -> bool:
        """Whether decode-written K/V is stored, for an engine whose K/V is `kv_dtype`.

        By default only in float32: decode-written K/V differs from a prefill's in its
        last bits (other kernels), which in float32 is ~1e-7 relative and left every
        greedy output we measured unchanged, while in bf16/fp16 it can change a later
        token (see docs/vllm.md). An explicit `save_decode` wins.
        """
        return kv_dtype == "float32" if self.save_decode is None else self.save_decode

    def chunk_tokens_for(self, block_size: int) -> int:
        """The chunk length for an engine with `block_size`-token blocks: `chunk_tokens`, by
        default `DEFAULT_CHUNK_TOKENS` rounded up to whole blocks."""
        chunk = self.chunk_tokens or -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
        if chunk % block_size:
            raise ValueError(
                f"chunk_tokens {chunk} is not a multiple of the block size {block_size}"
            )
        return chunk


def salted_namespace(namespace: str, cache_salt: str | None) -> str:
    """The namespace a request's KV lives in: its `cache_salt` keeps tenants apart.

    The salt is hashed (it may be any string, even a secret) and appended, so two
    salts never share KV and a salted request never reads unsalted KV.
    """
    if not cache_salt:
        return namespace
    import hashlib

    digest = hashlib.blake2b(f"{namespace}\0{cache_salt}".encode(), digest_size=8).hexdigest()
    return validate_namespace(f"{namespace[:106]}.salt-{digest}")  # 128 characters at most


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"expected a boolean, got {value!r}")
