"""An anchor correction as full-reuse plan spans of the HF loop (`anchor_spans`)."""

from __future__ import annotations

from kvsplice.client.execute.plan import PlanSpan
from kvsplice.kvmath.anchor_correction import AnchorCorrection


def anchor_spans(
    correction: AnchorCorrection, position_offset: int = 0, name: str = "anchor"
) -> tuple[PlanSpan, ...]:
    """Full-reuse spans (every layer reads the corrected K/V) for a plan at `position_offset`."""
    segments = [correction.placeholder]
    if correction.next_text is not None:
        segments.append(correction.next_text)
    spans = []
    for part, segment in zip(("placeholder", "next"), segments, strict=False):
        start = segment.start_position - position_offset
        spans.append(PlanSpan(
            start, start + segment.num_tokens, segment.num_layers, segment,
            name=f"{name}:{part}",
        ))  # fmt: skip
    return tuple(spans)
