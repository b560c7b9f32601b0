"""Reuse policies end to end on a tiny random Llama against an in-process store."""

from __future__ import annotations

from itertools import pairwise

import pytest
from helpers.client import make_loaded, make_store_engine
from helpers.client import store_target as store_target  # fixture
from helpers.kv import random_segment
from helpers.text import FakePrompt, make_prompt

from kvsplice.client.execute.execution import GenerationConfig, reuse_map
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.base import PlanBuilder
from kvsplice.client.reuse_engine import CallOutcome, EngineConfig, ReuseEngine
from kvsplice.common.keys import context_key, root_key
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

GENERATION = GenerationConfig(max_new_tokens=6, stop_token_ids=(127,))
SYSTEM = "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nProblem:\n"
CLOSING = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ("what is two plus two?", "name a prime number")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded()


def agent_prompt(question: str, upstream: tuple[int, ...] | None = None) -> FakePrompt:
    parts: list[tuple[str, str, str | tuple[int, ...]]] = [
        ("text", "text_0", SYSTEM),
        ("placeholder", "user_question", question),
    ]
    if upstream is not None:  # the upstream answer goes in as its generated ids
        parts += [
            ("text", "text_2", "\nAgent 1 said:\n"),
            ("placeholder", "agent_1_current", upstream),
        ]
    return make_prompt([*parts, ("text", "text_9", CLOSING)])


def run_two_agents(engine: ReuseEngine, question: str) -> list[tuple[FakePrompt, CallOutcome]]:
    first_prompt = agent_prompt(question)
    first = engine.run(first_prompt, GENERATION)
    second_prompt = agent_prompt(question, first.output_ids or (32,))
    return [(first_prompt, first), (second_prompt, engine.run(second_prompt, GENERATION))]


def test_exact_mode_equals_dense_and_reuses_cached_system_prompt(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(loaded, "exact", store_target, "policies-exact")
    calls = [call for q in QUESTIONS for call in run_two_agents(engine, q)]
    for prompt, outcome in calls:
        reference = engine.dense_reference(prompt, GENERATION)
        assert outcome.generated_ids == reference.generated_ids
        assert (outcome.logits_first - reference.logits_first).abs().max() <= 1e-4
        assert all(r.exact and r.delta == 0 and r.mode == "exact" for r in outcome.reused)
    first_of_second_sample = calls[2][1]
    assert first_of_second_sample.num_reused_tokens == len(loaded.tokenizer.encode(SYSTEM))
    assert first_of_second_sample.ttft_s > first_of_second_sample.timings.lookup_s > 0


def test_exact_repeat_reuses_all_but_the_last_token_and_stores_nothing_new(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(loaded, "exact", store_target, "policies-repeat")
    assert isinstance(engine.store, StoreClient)
    prompt = agent_prompt(QUESTIONS[1])
    first = engine.run(prompt, GENERATION)
    engine.flush()  # exact puts in the background
    stats_before = engine.store.stats()
    again = engine.run(prompt, GENERATION)
    engine.flush()
    stats_after = engine.store.stats()
    assert again.num_reused_tokens == len(prompt.token_ids) - 1
    assert again.generated_ids == first.generated_ids
    assert stats_before is not None and stats_after is not None
    assert stats_after.num_segments == stats_before.num_segments


def test_naive_reuses_more_than_exact_and_stores_question_base_once(
    loaded: LoadedModel, store_target: str
) -> None:
    reused = {}
    for mode in ("exact", "naive"):
        engine = make_store_engine(loaded, mode, store_target, f"policies-more-{mode}")
        calls = [call for q in QUESTIONS for call in run_two_agents(engine, q)]
        reused[mode] = sum(outcome.num_reused_tokens for _, outcome in calls)
        approximate = sum(r.num_tokens for _, o in calls for r in o.reused if not r.exact)
        assert engine.store is not None and engine.store.flush_reports()
        stats = engine.store.stats()  # the sidecar counts approximate tokens apart
        assert stats is not None and stats.num_hit_tokens == reused[mode]
        assert stats.num_approximate_hit_tokens == approximate
        assert (approximate > 0) == (mode == "naive")  # exact reuse never counts as approximate
        if mode == "naive":
            first, second = calls[0][1], calls[1][1]
            assert first.timings.base_prefill_s > 0 and second.timings.base_prefill_s == 0
            assert first.ttft_s > first.timings.base_prefill_s
            names = {r.name: r for r in second.reused}
            assert names["agent_1_current"].mode == "naive" and not names["agent_1_current"].exact
            question_ids = loaded.tokenizer.encode(QUESTIONS[0])
            base_key = context_key(root_key(loaded.fingerprint), question_ids)
            assert engine.store is not None and engine.store.get_segment(base_key) is not None
    assert reused["naive"] > reused["exact"] > 0


def test_naive_segments_stay_off_the_exact_chain(loaded: LoadedModel, store_target: str) -> None:
    engine = make_store_engine(loaded, "naive", store_target, "policies-offchain")
    _, (prompt, second) = run_two_agents(engine, QUESTIONS[0])
    assert engine.store is not None
    # Only the system prompt was computed with its true left context; everything
    # after the naively reused question is approximate and must not chain exactly.
    lookup = engine.store.lookup_prefix(loaded.fingerprint, prompt.token_ids)
    assert lookup.num_matched_tokens == len(loaded.tokenizer.encode(SYSTEM))
    assert second.num_reused_tokens > lookup.num_matched_tokens


def test_unreachable_store_falls_back_to_dense(loaded: LoadedModel) -> None:
    config = StoreClientConfig(
        lookup_timeout_s=0.05, get_timeout_s=0.05, put_timeout_s=0.05, max_attempts=1
    )
    dead = StoreClient("127.0.0.1:1", "policies-dead", config=config)
    for mode in ("exact", "naive"):
        # Without a local tier: this worker's own segments would be exact hits even so.
        config = EngineConfig(quant="none", local_tier_bytes=0)
        engine = ReuseEngine(loaded, mode, dead, config)
        for prompt, outcome in run_two_agents(engine, QUESTIONS[0]):
            reference = engine.dense_reference(prompt, GENERATION)
            assert outcome.num_reused_tokens == 0
            assert outcome.generated_ids == reference.generated_ids
    assert dead.counters.num_degraded_calls > 0


def test_exact_without_store_is_dense(loaded: LoadedModel) -> None:
    engine = ReuseEngine(loaded, "exact", None)
    prompt = agent_prompt(QUESTIONS[0])
    outcome, reference = engine.run(prompt, GENERATION), engine.dense_reference(prompt, GENERATION)
    assert outcome.num_reused_tokens == 0 and outcome.generated_ids == reference.generated_ids


def test_plan_builder_fills_gaps_and_computes_the_last_token() -> None:
    builder = PlanBuilder(range(10))
    builder.reuse(2, random_segment(2, 3, 7), "naive", exact=False)
    builder.reuse(6, random_segment(2, 4, 0), "naive", exact=False)
    plan = builder.build()
    assert [(s.start, s.end, s.computed) for s in plan.spans] == [
        (0, 2, True), (2, 5, False), (5, 6, True), (6, 9, False), (9, 10, True),
    ]  # fmt: skip
    assert plan.spans[1].delta == 2 - 7 and plan.spans[3].delta == 6
    assert reuse_map(plan, num_layers=2).num_reused_tokens == 6
    with pytest.raises(ValueError, match="overlaps"):
        builder.reuse(8, random_segment(2, 1, 0), "naive", exact=False)


def test_unknown_mode_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(ValueError, match="mode"):
        ReuseEngine(loaded, "psychic")


def test_naive_question_from_context_takes_it_as_another_prompt_computed_it(
    loaded: LoadedModel, store_target: str
) -> None:
    from kvsplice.client.modes.naive import NaivePolicy, Params

    engine = make_store_engine(
        loaded, NaivePolicy(Params(question="context")), store_target, "policies-context"
    )
    first_prompt = agent_prompt(QUESTIONS[0])
    first = engine.run(first_prompt, GENERATION)
    engine.flush()
    # nobody had computed the question inside a prompt: computed here, no standalone base
    assert first.timings.base_prefill_s == 0
    assert all(r.exact for r in first.reused)
    question_ids = loaded.tokenizer.encode(QUESTIONS[0])
    assert engine.store is not None
    base_key = context_key(root_key(loaded.fingerprint), question_ids)
    assert engine.store.get_segment(base_key) is None
    # another agent, under its own system prompt: the question comes from the first prompt
    reviewer = "<|im_start|>system\nYou review every sum twice, slowly.<|im_end|>\n<|im_start|>user\nProblem:\n"
    second_prompt = make_prompt(
        [("text", "text_0", reviewer), ("placeholder", "user_question", QUESTIONS[0]),
         ("text", "text_9", CLOSING)]
    )  # fmt: skip
    second = engine.run(second_prompt, GENERATION)
    names = {r.name: r for r in second.reused}
    question = names["user_question"]
    first_start = next(s.start for s in first_prompt.spans if s.name == "user_question")
    second_start = next(s.start for s in second_prompt.spans if s.name == "user_question")
    assert question.mode == "naive" and not question.exact
    assert question.delta == second_start - first_start != 0  # moved by the RoPE delta
    assert second.timings.base_prefill_s == 0
    # the default takes the question's standalone base instead
    engine = make_store_engine(loaded, "naive", store_target, "policies-context-base")
    engine.run(first_prompt, GENERATION)
    assert engine.run(second_prompt, GENERATION).timings.base_prefill_s == 0  # stored once
    assert engine.store is not None and engine.store.get_segment(base_key) is not None


def test_naive_answers_from_context_take_only_what_a_prompt_quoted(
    loaded: LoadedModel, store_target: str
) -> None:
    from kvsplice.client.modes.naive import NaivePolicy, Params

    policy = NaivePolicy(Params(question="context", answers="context"))
    engine = make_store_engine(loaded, policy, store_target, "policies-answers-context")
    (_, first), (second_prompt, second) = run_two_agents(engine, QUESTIONS[1])
    engine.flush()
    # the answer was only generated (its K/V captured by decode steps), never quoted: computed
    assert "agent_1_current" not in {r.name for r in second.reused}
    # another agent under its own system prompt quotes it: taken from the second prompt
    answer = first.output_ids or (32,)
    critic = "<|im_start|>system\nYou check answers.<|im_end|>\n<|im_start|>user\nProblem:\n"
    third_prompt = make_prompt(
        [("text", "text_0", critic), ("placeholder", "user_question", QUESTIONS[1]),
         ("text", "text_2", "\nAgent 1 said:\n"), ("placeholder", "agent_1_current", answer),
         ("text", "text_9", CLOSING)]
    )  # fmt: skip
    third = engine.run(third_prompt, GENERATION)
    names = {r.name: r for r in third.reused}
    quoted = names["agent_1_current"]
    start = {s.name: s.start for s in second_prompt.spans}["agent_1_current"]
    here = {s.name: s.start for s in third_prompt.spans}["agent_1_current"]
    assert quoted.mode == "naive" and not quoted.exact
    assert quoted.delta == here - start != 0  # moved from where the second prompt computed it
    # the default takes the generated answer as soon as it exists
    engine = make_store_engine(loaded, "naive", store_target, "policies-answers-any")
    (_, _), (_, second_any) = run_two_agents(engine, QUESTIONS[1])
    assert {r.name: r for r in second_any.reused}["agent_1_current"].mode == "naive"


def test_naive_prefix_reuses_only_the_run_from_the_start(
    loaded: LoadedModel, store_target: str
) -> None:
    from kvsplice.client.modes.naive import NaivePolicy, Params

    def second_call(params: Params, namespace: str) -> CallOutcome:
        engine = make_store_engine(loaded, NaivePolicy(params), store_target, namespace)
        (_, _), (_, second) = run_two_agents(engine, QUESTIONS[0])
        return second

    # the quoted answer has no prompt to come from: computed; the closing text after it
    # was stored with the first prompt and is reused, unless only a run from the start is
    every = second_call(Params(answers="context"), "policies-prefix-every")
    assert "text_9" in {r.name for r in every.reused if not r.exact}
    run = second_call(Params(answers="context", prefix=1), "policies-prefix-run")
    assert run.reused and all(r.exact for r in run.reused)
    assert run.num_reused_tokens < every.num_reused_tokens
    # one unbroken run from the prompt's start
    ends = sorted((r.start, r.start + r.num_tokens) for r in run.reused)
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(ends))
