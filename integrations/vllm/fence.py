"""The approximate fence: where a request's K/V stops being exact, and what that keeps from others.

From the fence on, the request's chunks are saved off-chain (`leave_exact_at`: no exact
lookup reaches them) and vLLM's prefix cache never serves its blocks to another request
(`place` rewrites `request.block_hashes`). Knows vLLM's request only by `block_hashes`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvsplice.common.keys import KeyChain


@dataclass
class Fence:
    position: int | None = None  # the request's first token whose K/V may be approximate

    def place(self, request: Any, position: int, hash_block_size: int) -> None:
        """From `position` on the request's K/V may be approximate.

        NOTE: vLLM caches a request's blocks under `request.block_hashes` (chained: each
        covers the whole prefix before it) right after this promise is allocated. The
        hashes from `position` on are replaced by random ones, so no later request can
        hash to them; the hashes vLLM appends later chain from these, so they are unique
        too. Blocks before `position` keep their hashes: their K/V is exact.
        """
        hashes = getattr(request, "block_hashes", None)
        if hashes is not None:
            for i in range(position // hash_block_size, len(hashes)):
                hashes[i] = os.urandom(32)
        if self.position is None or position < self.position:
            self.position = position

    def crossed_by(self, chain: KeyChain, end: int) -> bool:
        """Whether `chain` is still exact and its next link, ending at `end`, reaches past
        the fence (that link was computed over approximate K/V)."""
        return chain.exact and self.position is not None and end > self.position

    def leave_exact_at(self, chain: KeyChain, end: int) -> None:
        """Move `chain` off-chain for good if its next link, ending at `end`, crosses."""
        if self.crossed_by(chain, end):
            chain.leave_exact()
