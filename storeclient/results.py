"""Results the store clients return: small frozen records, free of protobuf.

A miss is an empty result (`PrefixLookup.MISS`, `[]`, `None`), never an exception.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class SegmentRef:
    """Where a stored segment sits and what it holds (no tokens, no payload)."""

    context_key: bytes  # 16 bytes, as the wire carries it
    start_position: int
    num_tokens: int
    layer_start: int
    layer_end: int  # exclusive
    payload_nbytes: int

    @property
    def segment_id(self) -> str:
        """The context key in hex (how logs and ids name a segment)."""
        return self.context_key.hex()

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_tokens


@dataclass(frozen=True)
class PrefixLookup:
    """Consecutive segments covering the first `num_matched_tokens` query tokens."""

    segments: tuple[SegmentRef, ...]
    num_matched_tokens: int

    MISS: ClassVar[PrefixLookup]


PrefixLookup.MISS = PrefixLookup(segments=(), num_matched_tokens=0)


@dataclass(frozen=True)
class SimilarCandidate:
    """A segment whose tokens resemble the query, with the evidence the server verified.

    `token_ids` and `exact` (its K/V equal dense prefill of its whole left context, as
    `SegmentMeta.exact`) only when asked (`find_similar(with_token_ids=True)`): else `()`
    and False, as from a sidecar older than the field.
    """

    segment: SegmentRef
    estimated_jaccard: float
    exact_tokens: bool
    same_left_context: bool
    exact_window: int
    token_ids: tuple[int, ...] = ()
    exact: bool = False


@dataclass(frozen=True)
class AnchorEntry:
    """One anchor of a placeholder's pool; payloads are empty unless requested.

    agent_ids: the agents holding offsets in it (listed with or without payloads).
    """

    anchor_id: str
    num_tokens: int
    activation_count: int
    created_seq: int
    base_payload: bytes = b""
    agent_payloads: Mapping[str, bytes] = field(default_factory=dict)
    agent_ids: tuple[str, ...] = ()


@dataclass
class ClientCounters:
    """What the client turned into misses, for tests and worker-side metrics."""

    num_degraded_calls: int = 0  # store unreachable or past its deadline
    num_corrupt_payloads: int = 0  # checksum or length failed on get
    num_same_host_reads: int = 0  # gets served in place from the sidecar's host (no gRPC)
    num_staged_puts: int = 0  # puts whose payload went through the staging file (no stream)
    num_reports_sent: int = 0  # reuse reports the sidecar took (`report_reuse`)
    num_reports_dropped: int = 0  # ... it refused (no write permission, bad report)


@dataclass(frozen=True)
class DataPlaneInfo:
    """Where the sidecar's segments can be read in place (`lmdb_path` "" : nowhere)."""

    host_id: str
    lmdb_path: str
    lmdb_file_id: tuple[int, int]
    server_pid: int
    staging_dir: str = ""  # where a put's payload may be staged (`common.staging`); "": nowhere


@dataclass(frozen=True)
class SessionRenewal:
    """The sidecar's answer to a session renewal (`storage.sessions.HoldOutcome` values)."""

    outcome: str  # "accepted", "clipped" or "rejected"
    lease_s: float  # the lease granted
    reason: str = ""
