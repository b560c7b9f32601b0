"""The replay's trace: 5-agent pipelines (planner, two solvers, critic, judge) sharing prefixes,
starting and ending over time, beside one-off requests without a session. Pure and seeded.

A prompt is a tuple of block names, one chunk each; a chunk's identity is its whole left
context (the store's chained keys), so blocks only say which prompts share a prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsplice.eval.bench.sessions.config import SessionBenchConfig

SYSTEM = ("system.0", "system.1")  # one workflow's system prompt: every agent's first chunks
NUM_TASK_BLOCKS, NUM_PLAN_BLOCKS, NUM_SOLUTION_BLOCKS, NUM_CRITIQUE_BLOCKS = 4, 2, 3, 2
ROLES = ("planner", "solver", "critic", "judge")


@dataclass(frozen=True)
class TraceRequest:
    time_s: float
    seq: int  # order among requests of the same instant
    session_id: str | None  # None: a one-off request
    role: str  # one of ROLES, or "background"
    blocks: tuple[str, ...]
    release: bool = False  # carries the session's release hint (the pipeline's last call)


def build_trace(config: SessionBenchConfig) -> list[TraceRequest]:
    """Every request of the trace in time order."""
    rng = random.Random(config.seed)
    spacing_s = _expected_duration_s(config) / config.concurrency
    requests: list[TraceRequest] = []
    start_s = 0.0
    for index in range(config.num_sessions):
        start_s += rng.expovariate(1.0 / spacing_s)
        requests += _pipeline(config, rng, index, start_s)
    end_s = start_s
    rate = config.background_per_session / spacing_s
    time_s = rng.expovariate(rate) if rate > 0 else end_s + 1
    index = 0
    while time_s < end_s:
        requests.append(_background(config, rng, index, time_s))
        time_s += rng.expovariate(rate)
        index += 1
    ordered = sorted(requests, key=lambda r: (r.time_s, r.seq))
    return [
        TraceRequest(r.time_s, i, r.session_id, r.role, r.blocks, r.release)
        for i, r in enumerate(ordered)
    ]


def _expected_duration_s(config: SessionBenchConfig) -> float:
    mean_agent_s = sum(config.agent_s) / 2
    return 3 * mean_agent_s + config.pause_share * sum(config.pause_s) / 2


def _pipeline(
    config: SessionBenchConfig, rng: random.Random, index: int, start_s: float
) -> list[TraceRequest]:
    name = f"pipeline-{index}"

    def blocks(kind: str, count: int) -> tuple[str, ...]:
        return tuple(f"{name}.{kind}.{i}" for i in range(count))

    def agent_s() -> float:
        return rng.uniform(*config.agent_s)

    task, plan = blocks("task", NUM_TASK_BLOCKS), blocks("plan", NUM_PLAN_BLOCKS)
    solutions = blocks("solution-a", NUM_SOLUTION_BLOCKS) + blocks("solution-b", 3)
    critique = blocks("critique", NUM_CRITIQUE_BLOCKS)
    solvers_s = start_s + agent_s()
    critic_s = solvers_s + max(agent_s(), agent_s())
    if rng.random() < config.pause_share:
        critic_s += rng.uniform(*config.pause_s)
    judge_s = critic_s + agent_s()
    released = rng.random() >= config.abandoned_share
    base = (*SYSTEM, *task)
    calls = [
        (start_s, "planner", (*base, f"{name}.instruction.planner"), False),
        (solvers_s, "solver", (*base, *plan, f"{name}.instruction.solver-a"), False),
        (solvers_s + 0.5, "solver", (*base, *plan, f"{name}.instruction.solver-b"), False),
        (critic_s, "critic", (*base, *plan, *solutions, f"{name}.instruction.critic"), False),
        (judge_s, "judge", (*base, *plan, *solutions, *critique, f"{name}.instruction.judge"),
         released),
    ]  # fmt: skip
    return [TraceRequest(t, 0, name, role, b, release) for t, role, b, release in calls]


def _background(
    config: SessionBenchConfig, rng: random.Random, index: int, time_s: float
) -> TraceRequest:
    name = f"one-off-{index}"
    if rng.random() < config.popular_share:
        doc = rng.randrange(config.num_popular)
        body = tuple(f"popular-{doc}.{i}" for i in range(config.background_chunks - 1))
        blocks = (*body, f"{name}.question")
    else:
        blocks = tuple(f"{name}.{i}" for i in range(config.background_chunks))
    return TraceRequest(time_s, 0, None, "background", blocks)
