"""Agent TTFT from a stated cost model: hit tokens loaded, missed tokens prefilled.

Both per-token costs come from one row of a committed `kvsplice bench core` JSON: prefill is
its dense prefill over its tokens; a load is its lookup, fetch, decode, shift and splice
stages over its tokens (the reuse call less the prefill of what it did not reuse). Linear in
tokens: attention's quadratic part is left out, which flatters long misses, not hits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LOAD_STAGES = ("lookup_s", "fetch_s", "decode_s", "shift_s", "splice_s")


@dataclass(frozen=True)
class CostModel:
    prefill_s_per_token: float
    load_s_per_token: float
    source: str  # which file and row

    def ttft_s(self, num_hit_tokens: int, num_prompt_tokens: int) -> float:
        num_missed = num_prompt_tokens - num_hit_tokens
        return num_missed * self.prefill_s_per_token + num_hit_tokens * self.load_s_per_token


def cost_model(path: str, num_tokens: int, num_threads: int) -> CostModel:
    """The row of `path` measured at `num_tokens` tokens on `num_threads` threads."""
    rows = json.loads(Path(path).read_text())["rows"]
    for row in rows:
        if row["num_tokens"] == num_tokens and row["num_threads"] == num_threads:
            load_s = sum(row["stages_s"][stage] for stage in LOAD_STAGES)
            return CostModel(
                row["dense_prefill_s"] / num_tokens,
                load_s / num_tokens,
                f"{path}: row num_tokens={num_tokens}, num_threads={num_threads}",
            )
    raise ValueError(f"{path} has no row of {num_tokens} tokens at {num_threads} threads")
