"""`exact_match`: an anchor of the query's own sample (same base, at any position) is found;
one whose base differs by more than the tolerance, or that holds no offsets for the
context, is not."""

from __future__ import annotations

import pytest
import torch

from kvsplice.kvmath.anchor_gate import exact_match
from kvsplice.kvmath.anchors import AgentOffsets, Anchor
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

ROPE = RopeSpec.uniform(8, 10_000.0, 2)
STATES = torch.randn(2, 1, 5, 8, generator=torch.Generator().manual_seed(3))
VALUES = torch.randn(2, 1, 5, 8, generator=torch.Generator().manual_seed(4))


def at(position: int, bump: float = 0.0) -> SegmentKV:
    keys = ROPE.shift_layers(STATES + bump, torch.arange(position, position + 5))
    return SegmentKV(keys, VALUES + bump, start_position=position)


def anchor(base: SegmentKV, agent: str = "ctx") -> Anchor:
    return Anchor("a", base, {agent: AgentOffsets(base)})


@pytest.mark.parametrize(
    ("base", "agent", "found"),
    [
        (at(3), "ctx", True),  # the same sample, stored at another position
        (at(9), "ctx", True),
        (at(9, bump=1e-3), "ctx", False),  # broken: another sample, however close
        (at(9), "other", False),  # broken: offsets of another context
    ],
)
def test_only_the_query_s_own_sample_matches(base: SegmentKV, agent: str, found: bool) -> None:
    assert (exact_match(at(20), [anchor(base, agent)], ROPE, "ctx") is not None) == found
