"""Fakes of what the scheduler half reads from vLLM's `Request` and `SchedulerOutput` (vLLM 0.32)
and of the sidecar, shared by the scheduler-half tests (the engine tests run the real ones)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvsplice.common.keys import chunk_links
from kvsplice.integrations.vllm.connector_config import ConnectorConfig
from kvsplice.integrations.vllm.scheduler_side import SchedulerSide
from kvsplice.storeclient.results import PrefixLookup, SegmentRef

FINGERPRINT = "kvfp1-" + "cd" * 16
BLOCK = 4


@dataclass
class FakeStore:
    stored_tokens: list[int]  # the sidecar holds the chunk chain over these tokens
    lookups: list[tuple[str, int]] = field(default_factory=list)
    namespace: str = ""
    roots: list[str] = field(default_factory=list)  # the fingerprint of each lookup
    counters: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(num_degraded_calls=0, num_corrupt_payloads=0)
    )

    def lookup_prefix(
        self, fingerprint: str, token_ids: list[int], session_id: str = ""
    ) -> PrefixLookup:
        self.lookups.append((self.namespace, len(token_ids)))
        self.roots.append(fingerprint)
        if fingerprint != FINGERPRINT:  # the chain is held under the plain model's root
            return PrefixLookup.MISS
        refs = []
        for link in chunk_links(fingerprint, self.stored_tokens, BLOCK):
            if list(token_ids[link.start : link.end]) != self.stored_tokens[link.start : link.end]:
                break
            refs.append(SegmentRef(link.key, link.start, link.num_tokens, 0, 2, 100))
        return PrefixLookup(tuple(refs), refs[-1].end_position if refs else 0)


class FakeClients:
    def __init__(self, store: FakeStore) -> None:
        self.config = ConnectorConfig("h:1", namespace="ns")
        self.store = store

    def for_namespace(self, namespace: str) -> FakeStore:
        self.store.namespace = namespace
        return self.store


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_prompt_tokens: int = 0
    prompt_embeds: object = None  # vLLM's Request fields the key reads (request_keys)
    lora_request: object = None
    mm_features: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Step:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


def make_side(
    stored: list[int], save_decode: bool = True, load_async: str = "never"
) -> tuple[SchedulerSide, FakeStore]:
    store = FakeStore(stored)
    clients = FakeClients(store)
    side = SchedulerSide(
        clients,  # type: ignore[arg-type]
        FINGERPRINT, BLOCK, BLOCK, save_decode=save_decode, load_async=load_async,
        lookup_wait_s=10.0,
    )  # fmt: skip
    return side, store


class BlockingStore(FakeStore):
    """A sidecar that answers only once `release` is set (or raises `error`)."""

    def __init__(self, stored: list[int], error: Exception | None = None) -> None:
        super().__init__(stored)
        self.release = threading.Event()
        self.error = error

    def lookup_prefix(
        self, fingerprint: str, token_ids: list[int], session_id: str = ""
    ) -> PrefixLookup:
        self.release.wait(10)
        if self.error is not None:
            self.lookups.append((self.namespace, len(token_ids)))
            raise self.error
        return super().lookup_prefix(fingerprint, token_ids)


def make_blocking_side(store: FakeStore, **kwargs: float) -> SchedulerSide:
    kwargs = {"lookup_wait_s": 0.01, "lookup_timeout_s": 5.0, **kwargs}
    return SchedulerSide(FakeClients(store), FINGERPRINT, BLOCK, BLOCK, **kwargs)  # type: ignore[arg-type]


def with_attrs(
    request: FakeRequest, lora: object, mm: list | None = None, prompt_embeds: object = None
) -> FakeRequest:
    request.lora_request = lora
    request.mm_features = mm or []
    request.prompt_embeds = prompt_embeds
    return request
