"""Judge Consistency Rate and the per-mode figures of a judge bench.

Owns `JudgeRecord` (one judge call of one mode beside the dense judge of the same
prompt), `candidate_token_layers` (how much of the candidate blocks' per-layer
prefill a call did not compute) and `summarize` (JCR, coverage, position bias,
accuracy, reuse and speedup per mode). Running the calls is the runner's job.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from kvsplice.client.modes.base import CandidateBlock
from kvsplice.client.modes.gated import FLOOR_GUARD, GUARD
from kvsplice.client.reuse_engine import ReusedSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JudgeRecord:
    """One example judged by `mode`, and the dense judge of the byte-identical prompt.

    `order`: agent ids in display order (both judges saw it). Agent ids are original
    ids; `*_parsed_agent_id` None where the generated text named no candidate.
    `*_correct`: whether the selected candidate's answer is right (None: uncheckable).
    Token·layer counts are over the candidate blocks (the answers in the judge prompt).
    `scores`/`dense_scores`: each judge's label logits by display slot (calibration
    bounds a mode's error on them).
    """

    example_id: str
    task: str
    mode: str
    order: tuple[str, ...]
    agent_id: str
    slot: int
    margin: float
    parsed_agent_id: str | None
    dense_agent_id: str
    dense_slot: int
    dense_margin: float
    dense_parsed_agent_id: str | None
    ttft_s: float
    dense_ttft_s: float
    num_prompt_tokens: int
    num_reused_tokens: int
    num_candidate_tokens: int
    num_candidate_token_layers_reused: int
    num_layers: int
    correct: bool | None = None
    dense_correct: bool | None = None
    text: str = ""
    dense_text: str = ""
    decisions: Mapping[str, str] = field(default_factory=dict)
    scores: tuple[float, ...] = ()
    dense_scores: tuple[float, ...] = ()

    @property
    def consistent(self) -> bool:
        """The constrained reads agree: same original agent as the dense judge."""
        return self.agent_id == self.dense_agent_id

    @property
    def covered(self) -> bool:
        """Both generated texts named a candidate."""
        return self.parsed_agent_id is not None and self.dense_parsed_agent_id is not None

    def to_dict(self) -> dict[str, object]:
        record = asdict(self)
        record["decisions"] = dict(self.decisions)
        return record


def candidate_token_layers(
    candidates: Sequence[CandidateBlock], reused: Iterable[ReusedSpan]
) -> int:
    """Σ candidate tokens × layers whose K/V the call reused (not computed)."""
    total = 0
    for span in reused:
        end = span.start + span.num_tokens
        for block in candidates:
            overlap = min(end, block.end) - max(span.start, block.start)
            if overlap > 0:
                total += overlap * span.num_layers
    return total


@dataclass(frozen=True)
class ModeSummary:
    """One mode's figures over its examples (fractions in [0, 1]).

    jcr: constrained reads agreeing with dense; coverage: share of examples where both
    texts named a candidate, jcr_text: agreement of the texts among those;
    position_bias[k]: share of examples where display slot k was selected (dense_*: the
    dense judge's); accuracy: share of checkable examples whose selected answer is right
    (None: none checkable); token_reuse: reused / prompt tokens of the judge calls;
    candidate_token_layer_reuse: share of the candidate blocks' token·layers not
    computed; speedup: Σ dense TTFT / Σ this mode's TTFT (every cost of the reuse path
    counted); flips: examples whose selection differs from dense; routes: calls per route
    taken (`call_route`; a mode that does not route: its own name).
    """

    mode: str
    examples: int
    jcr: float
    coverage: float
    jcr_text: float | None
    position_bias: tuple[float, ...]
    dense_position_bias: tuple[float, ...]
    accuracy: float | None
    dense_accuracy: float | None
    token_reuse: float
    candidate_token_layer_reuse: float
    speedup: float
    mean_ttft_s: float
    mean_dense_ttft_s: float
    flips: tuple[str, ...]
    routes: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(records: Sequence[JudgeRecord]) -> list[ModeSummary]:
    """One summary per mode, in the order modes first appear in `records`."""
    by_mode: dict[str, list[JudgeRecord]] = {}
    for record in records:
        by_mode.setdefault(record.mode, []).append(record)
    return [_summary(mode, group) for mode, group in by_mode.items()]


def _summary(mode: str, group: Sequence[JudgeRecord]) -> ModeSummary:
    covered = [r for r in group if r.covered]
    num_slots = max(len(r.order) for r in group)
    token_layers = sum(r.num_candidate_tokens * r.num_layers for r in group)
    ttft = sum(r.ttft_s for r in group)
    dense_ttft = sum(r.dense_ttft_s for r in group)
    return ModeSummary(
        mode=mode,
        examples=len(group),
        jcr=_share(r.consistent for r in group),
        coverage=len(covered) / len(group),
        jcr_text=_share(r.parsed_agent_id == r.dense_parsed_agent_id for r in covered)
        if covered
        else None,
        position_bias=_bias((r.slot for r in group), num_slots, len(group)),
        dense_position_bias=_bias((r.dense_slot for r in group), num_slots, len(group)),
        accuracy=_checkable_share(r.correct for r in group),
        dense_accuracy=_checkable_share(r.dense_correct for r in group),
        token_reuse=_ratio(sum(r.num_reused_tokens for r in group),
                           sum(r.num_prompt_tokens for r in group)),
        candidate_token_layer_reuse=_ratio(
            sum(r.num_candidate_token_layers_reused for r in group), token_layers
        ),
        speedup=dense_ttft / ttft if ttft > 0 else 0.0,
        mean_ttft_s=ttft / len(group),
        mean_dense_ttft_s=dense_ttft / len(group),
        flips=tuple(r.example_id for r in group if not r.consistent),
        routes=dict(sorted(Counter(call_route(r.mode, r.decisions) for r in group).items())),
    )  # fmt: skip


ROUTED = re.compile(r"-> (?P<mode>[\w:=+.]+):")
KEPT_AT = re.compile(r"^kept: .*? at check (?P<check>\d+)")  # the pass that kept it
# the gate's noise-floor guards: "dense: ..." when the routed prefill decided by less than
# the dtype's noise floor and was redone densely
FLOOR_GUARDS = (GUARD, FLOOR_GUARD)


def call_route(mode: str, decisions: Mapping[str, str]) -> str:
    """Where a call went: the gate's route ("exact", "dense", "crossfix"), a staged judge
    mode's pass ("crossfix@4": kept at check 4, "crossfix>dense": every pass refused), or
    a route whose prefill the gate's noise floor sent dense ("crossfix>floor", "exact>floor")."""
    routed = ROUTED.search(decisions.get("gated", ""))
    route = routed.group("mode") if routed else mode.split(":", 1)[0]
    if any(decisions.get(guard, "").startswith("dense:") for guard in FLOOR_GUARDS):
        return f"{route}>floor"
    staged = decisions.get(route, "")
    if (kept := KEPT_AT.match(staged)) is not None:
        return f"{route}@{kept.group('check')}"
    if staged.startswith("dense:"):
        return f"{route}>dense"
    return route


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else 0.0


def _checkable_share(flags: Iterable[bool | None]) -> float | None:
    checkable = [f for f in flags if f is not None]
    return sum(checkable) / len(checkable) if checkable else None


def _bias(slots: Iterable[int], num_slots: int, total: int) -> tuple[float, ...]:
    counts = [0] * num_slots
    for slot in slots:
        counts[slot] += 1
    return tuple(c / total for c in counts)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
