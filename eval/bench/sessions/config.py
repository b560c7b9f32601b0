"""`SessionBenchConfig` and the flags of `kvsplice bench sessions` beside its fields: the trace
of agent pipelines, the store's budgets and the cost model's source. Imports nothing heavy.

NOTE: the trace's parameters below were fixed before the replay was first run; they are not
tuned to its results (docs/operations.md, "Sessions", says how they were chosen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsplice.common.config_flags import MIB, flag

DEFAULT_COST_JSON = "docs/bench-core-2026-12-02.json"


@dataclass(frozen=True)
class SessionBenchConfig:
    """A trace of `num_sessions` 5-agent pipelines (planner, two solvers, critic, judge), about
    `concurrency` live at once, beside one-off requests without a session, replayed into the
    real store (memory tier over LMDB at these budgets) with sessions and without.

    Chunks are `chunk_tokens` tokens of `bytes_per_token` payload bytes each (the budgets are
    in the same units, so their ratio to the trace's K/V is what matters). Agents generate for
    `agent_s` (low, high) seconds; a `pause_share` of pipelines waits `pause_s` before the
    critic (a tool run); an `abandoned_share` never sends its release hint (it expires).
    `background_per_session` one-off requests arrive per pipeline started, a `popular_share`
    of them over one of `num_popular` shared documents. TTFT is costed from `cost_json`'s
    row of `cost_tokens` tokens at `cost_threads` threads (`cost`). `sweep_lmdb_mib`: the
    same trace at other LMDB budgets, reported beside the main result (declared with it).
    """

    num_sessions: int = flag(192, "Agent pipelines in the trace.", min=1)
    concurrency: int = flag(40, "Pipelines live at once (about).", min=1)
    lease_s: float = flag(120.0, "The sidecar's --session-lease-s in the replay.", min=1)
    memory_bytes: int = flag(4 * MIB, "Memory tier budget.", name="memory-mib", mib=True, min=1)
    lmdb_bytes: int = flag(16 * MIB, "LMDB tier budget.", name="lmdb-mib", mib=True, min=1)
    chunk_tokens: int = 256
    bytes_per_token: int = 64
    agent_s: tuple[float, float] = (5.0, 40.0)
    pause_share: float = 0.25
    pause_s: tuple[float, float] = (30.0, 100.0)
    abandoned_share: float = 0.2
    background_per_session: float = 3.0
    background_chunks: int = 8
    num_popular: int = 16
    popular_share: float = 0.3
    sweep_lmdb_mib: tuple[int, ...] = flag(
        (8, 10, 32),
        "LMDB budgets in MiB also replayed (sensitivity; '': none).",
        csv=True,
        min=1,
    )
    seed: int = flag(0, "Seed of the trace.")
    cost_json: str = flag(DEFAULT_COST_JSON, "Bench JSON whose row prices prefill and loads.")
    cost_tokens: int = 1024
    cost_threads: int = 1
    tmp_dir: str | None = flag(
        None, "Where the replay's LMDB lives.", path=True, exists=True, file_okay=False
    )
    json_path: str | None = flag(None, "Also write the result as JSON.", name="json", path=True)

    def __post_init__(self) -> None:
        for name in ("num_sessions", "concurrency", "chunk_tokens", "bytes_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        for name in ("pause_share", "abandoned_share", "popular_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} {getattr(self, name)} must be in [0, 1]")
        for name in ("agent_s", "pause_s"):
            low, high = getattr(self, name)
            if not (0 <= low <= high and math.isfinite(high)):
                raise ValueError(f"{name} {getattr(self, name)} must be 0 <= low <= high")
        if self.background_per_session < 0 or self.lease_s <= 0:
            raise ValueError("background_per_session must be >= 0 and lease_s > 0")

    @property
    def chunk_nbytes(self) -> int:
        return self.chunk_tokens * self.bytes_per_token
