"""Mode `naive`: position-only reuse (the KVComm/judge papers' baseline), no correction.

After the exact prefix, each later span takes K/V captured in another context,
moved to its position by a RoPE Δ-shift: an upstream agent's answer from the K/V
captured while it was generated, template text from any stored segment with the
same tokens, and the question, by default (`question=base`), from its standalone
base cache (prefilled alone at position 0, once per question; that prefill is in
the TTFT of the call that pays it). `naive:question=context` takes the question as
another prompt computed it instead (a stored prompt segment with the same tokens,
after that prompt's own system prompt: what an engine's connector can load), and
computes it where none is stored; `naive:answers=context` takes an earlier agent's
answer only from a prompt that quoted it (not from its generation); `naive:prefix=1`
stops reusing at the first span it computes. With all three
(`naive:question=context+answers=context+prefix=1`) the reused K/V is what the vLLM
connector loads for gated requests: spans computed inside other prompts, as one run
from the prompt's start. A span without a source is computed. The plan is
`shared.plan_position_only`, which blend and halo repair.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvsplice.client.modes.base import CallContext, ModeSpec, PlannedCall, SpannedPrompt
from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.client.modes.recorder import RecordingPolicy
from kvsplice.client.modes.shared import ANSWER_SOURCES, QUESTION_SOURCES, plan_position_only
from kvsplice.common.reuse_modes import NAIVE

logger = logging.getLogger(__name__)

MODE = NAIVE


@dataclass(frozen=True)
class Params:
    """naive's parameters (`naive:question=context`)."""

    question: str = knob(
        "base", "question",
        "a question's K/V: its standalone prefill (base) or as another prompt computed it "
        "(context; none stored: computed)",
        choices=QUESTION_SOURCES,
    )  # fmt: skip
    answers: str = knob(
        "any", "answers",
        "an earlier answer's K/V: any stored segment with its tokens (any: its generation or "
        "a prompt quoting it, the closer left context first) or only one computed inside a "
        "prompt that quoted it (context; none: computed)",
        choices=ANSWER_SOURCES,
    )  # fmt: skip
    prefix: int = knob(
        0, "prefix",
        "1: reuse only the unbroken run of spans with a source from the prompt's start, "
        "everything after the first computed span computed (what a KV connector can load); "
        "0: every span with one",
        low=0, high=1,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_ranges(self)


class NaivePolicy(RecordingPolicy):
    mode = MODE

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        p = self.params
        return plan_position_only(
            prompt, ctx, MODE, question=p.question, answers=p.answers, prefix=bool(p.prefix)
        )


SPEC = ModeSpec(MODE, Params, NaivePolicy)
