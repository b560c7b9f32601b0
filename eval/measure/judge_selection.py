"""Reading a judge's selection: the constrained choice at the decision position, and the text.

Owns `choice_token_ids`, `Selection` and `read_selection`. The primary read is the
argmax of the first-token logits over the display labels' tokens (always defined,
robust for a 135M model); the generated text is parsed too, and may fail (coverage).
Both are mapped from display slots back to agent ids through the `DisplayOrder`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsplice.agents.judge import DisplayOrder
from kvsplice.agents.render import Tokenizer

logger = logging.getLogger(__name__)

# The text after "Selected agent id: ": the label first ("3", "Agent 3", "<3>", "#3").
_LEADING_LABEL = re.compile(r"^\W*(?:agent\W*)?(\d+)\b", re.IGNORECASE)


def choice_token_ids(tokenizer: Tokenizer, labels: Sequence[str]) -> tuple[int, ...]:
    """The one token of each display label as the judge would write it after the decision
    line; `ValueError` when a label is not a single token (the constrained read needs one)."""
    ids = []
    for label in labels:
        encoded = tokenizer.encode(label, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"display label {label!r} is {len(encoded)} tokens, not one")
        ids.append(int(encoded[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"display labels {tuple(labels)} share a token")
    return tuple(ids)


@dataclass(frozen=True)
class Selection:
    """One judge call's choice. Slots are 0-based display slots; agent ids are original ids.

    `margin`: logit of the chosen label minus the runner-up's (the decision's confidence).
    `parsed_slot`: the slot the generated text names (None: it names none).
    `scores`: the label tokens' logits, slot by slot (what the constrained read compared).
    """

    slot: int
    agent_id: str
    margin: float
    parsed_slot: int | None
    parsed_agent_id: str | None
    text: str
    scores: tuple[float, ...] = ()


def constrained_slot(logits: torch.Tensor, choice_ids: Sequence[int]) -> tuple[int, float]:
    """The slot whose label token has the largest logit, and its margin over the next.

    logits: [V] at the decision position. Ties go to the lowest slot.
    """
    scores = logits.detach().float()[list(choice_ids)]
    top = torch.topk(scores, k=min(2, scores.numel()))
    slot = int(torch.argmax(scores))
    margin = float(top.values[0] - top.values[1]) if scores.numel() > 1 else float("inf")
    return slot, margin


def parse_slot(text: str, order: DisplayOrder) -> int | None:
    """The slot whose label the text starts with (after the decision line), else None."""
    match = _LEADING_LABEL.match(text)
    return None if match is None else order.slot_of_label(match.group(1))


def read_selection(
    logits: torch.Tensor, text: str, order: DisplayOrder, choice_ids: Sequence[int]
) -> Selection:
    """Both reads of one judge call, mapped back to agent ids through `order`."""
    slot, margin = constrained_slot(logits, choice_ids)
    parsed = parse_slot(text, order)
    return Selection(
        slot=slot,
        agent_id=order.agent_at(slot),
        margin=margin,
        parsed_slot=parsed,
        parsed_agent_id=None if parsed is None else order.agent_at(parsed),
        text=text,
        scores=tuple(float(x) for x in logits.detach().float()[list(choice_ids)]),
    )
