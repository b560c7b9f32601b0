"""The demo's last stage: a judge picks one of the pipeline's answers, with the risk gate at work.

Owns `DemoJudge` (the judge stage's summaries and the gate's routes), `judge_examples_of`
(each problem's candidates: the answers the dense pipeline produced, so every mode judges
the same ones), `run_demo_judge` and `gate_routes`. Judging is `bench.judge.runner`'s protocol;
the figures are `jcr`'s.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rich.table import Table

from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.common.reuse_modes import DENSE, GATED, NAIVE
from kvsplice.eval.bench.judge.runner import JudgeRunConfig, run_judges
from kvsplice.eval.measure.jcr import JudgeRecord, ModeSummary, summarize
from kvsplice.eval.measure.metrics import CallRecord
from kvsplice.eval.report.results import fmt_pct, fmt_x
from kvsplice.eval.workloads.judge_examples import JudgeExample
from kvsplice.eval.workloads.workload import Problem

logger = logging.getLogger(__name__)

JUDGE_MODES = (DENSE, NAIVE, GATED)
GATE_DECISION = GATED  # the gate's decision, keyed by its mode
MAX_CANDIDATES = 8


@dataclass(frozen=True)
class DemoJudge:
    """summaries: one per judge mode; routes: (stage, gate decision) → calls it routed so."""

    summaries: tuple[ModeSummary, ...]
    routes: Mapping[tuple[str, str], int]
    records: tuple[JudgeRecord, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "modes": [s.to_dict() for s in self.summaries],
            "gate_routes": [
                {"stage": stage, "decision": decision, "calls": n}
                for (stage, decision), n in self.routes.items()
            ],
            "records": [r.to_dict() for r in self.records],
        }


def judge_examples_of(
    records: Sequence[CallRecord], problems: Sequence[Problem]
) -> list[JudgeExample]:
    """Per problem, a HumanEval judge example whose candidates are the dense pipeline's answers
    (the first `MAX_CANDIDATES` agents, in pipeline order; empty answers left out)."""
    by_problem: dict[str, list[CallRecord]] = {}
    for record in records:
        if record.mode == DENSE and record.output_text.strip():
            by_problem.setdefault(record.problem_id, []).append(record)
    examples = []
    for problem in problems:
        answers = sorted(by_problem.get(problem.problem_id, []), key=lambda r: r.position)
        texts = tuple(r.output_text for r in answers[:MAX_CANDIDATES])
        if len(texts) >= 2:
            examples.append(
                JudgeExample(problem.problem_id, "humaneval", problem.question, texts,
                             problem.reference, problem)
            )  # fmt: skip
    return examples


def gate_routes(
    pipeline: Iterable[CallRecord], judges: Iterable[JudgeRecord]
) -> dict[tuple[str, str], int]:
    """How the gate routed each call of the gated mode: pipeline agents, then the judge."""
    routes: Counter[tuple[str, str]] = Counter()
    for call in pipeline:
        if call.mode == GATED and GATE_DECISION in call.decisions:
            routes[("pipeline", call.decisions[GATE_DECISION])] += 1
    for judge in judges:
        if judge.mode == GATED and GATE_DECISION in judge.decisions:
            routes[("judge", judge.decisions[GATE_DECISION])] += 1
    return dict(routes)


def run_demo_judge(
    loaded: LoadedModel,
    pipeline: Sequence[CallRecord],
    problems: Sequence[Problem],
    store_target: str,
    admission: AdmissionPolicy,
    *,
    namespace: str,
    store_token: str | None = None,
    max_new_tokens: int = 32,
    layout: str = "transcript",
) -> DemoJudge | None:
    """Judge each problem's answers in `JUDGE_MODES` (shuffled orders) in judge `layout`
    (`agents.judge.JUDGE_LAYOUTS`); None: too few answers."""
    examples = judge_examples_of(pipeline, problems)
    if not examples:
        return None
    config = JudgeRunConfig(
        modes=JUDGE_MODES, regime="progressive", shuffle=True, seed=0, warmup=False, layout=layout,
        max_new_tokens=max_new_tokens, namespace=namespace, store_token=store_token,
        admission=admission, num_candidates=max(len(e.candidates or ()) for e in examples),
    )  # fmt: skip
    run = run_judges(loaded, examples, config, store_target)
    return DemoJudge(tuple(summarize(run.records)), gate_routes(pipeline, run.records),
                     tuple(run.records))  # fmt: skip


def judge_table(judge: DemoJudge) -> Table:
    table = Table(
        "mode", "JCR", "coverage", "candidate token·layer reuse", "speedup", "examples",
        title="The judge over each problem's answers (shuffled order), vs the dense judge",
    )  # fmt: skip
    for s in judge.summaries:
        table.add_row(s.mode, fmt_pct(s.jcr), fmt_pct(s.coverage),
                      fmt_pct(s.candidate_token_layer_reuse), fmt_x(s.speedup), str(s.examples))  # fmt: skip
    return table


def routes_table(judge: DemoJudge) -> Table:
    table = Table(
        "stage", "risk gate decision", "calls", title="What the risk gate routed, and why"
    )
    for (stage, decision), count in sorted(judge.routes.items()):
        table.add_row(stage, decision, str(count))
    return table
