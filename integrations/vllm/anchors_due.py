"""Which runs become anchors, and when: the scheduler half's share of making anchors.

When the anchor gate refuses a request's runs, vLLM recomputes them in the request's own
context: exactly the in-context K/V an anchor needs beside the stored run (its base). The
scheduler half notes the refused runs (`worth`: a few, long enough), and in the step that
computes the last of them asks the worker to make the anchors (`due`, then `take`: an
`AnchorSpec` in that step's metadata). Torch-free; the tensors are `anchor_saves`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.span_search import MIN_SPAN_TOKENS
from kvsplice.integrations.vllm.transfer_specs import AnchorSpec

# At most this many runs of one request become anchors (each is a put of its base and
# offsets, about 2x its K/V in the payloads' scheme): cheap and bounded.
MAX_ANCHOR_RUNS = 8


class AnchorsDue:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._due: list[AnchorSpec] = []
        self.num_due = 0

    @staticmethod
    def worth(spans: Sequence[ReusedSpan]) -> tuple[ReusedSpan, ...]:
        """The refused runs to make anchors of: the first `MAX_ANCHOR_RUNS` long enough to
        be loaded at all (`MIN_SPAN_TOKENS`)."""
        return tuple(s for s in spans if s.num_tokens >= MIN_SPAN_TOKENS)[:MAX_ANCHOR_RUNS]

    def due(
        self, request_id: str, namespace: str, root: str, token_ids: Sequence[int],
        spans: tuple[ReusedSpan, ...], block_ids: Sequence[int],
    ) -> None:  # fmt: skip
        """The runs `spans` of the request are computed in its blocks `block_ids` (its
        block table) as of this step: make their anchors after it."""
        first = spans[0].start // self.block_size
        last = -(-spans[-1].end // self.block_size)
        if last > len(block_ids):
            return  # its blocks are not all known here (preempted): no anchor
        self._due.append(AnchorSpec(
            request_id, namespace, root, tuple(token_ids[: spans[-1].end]), spans,
            tuple(block_ids[first:last]), self.block_size,
        ))  # fmt: skip
        self.num_due += 1

    def take(self) -> list[AnchorSpec]:
        due, self._due = self._due, []
        return due
