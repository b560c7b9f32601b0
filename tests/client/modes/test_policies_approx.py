"""Approximate reuse policies (anchor, multicut, blend, halo) end to end on a tiny Llama.

Each runs a 2-agent chain against an embedded store; degenerate settings must
equal dense prefill, and every mode must fall back to dense without a store.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.approx import (
    CLOSING,
    GENERATION,
    NUM_LAYERS,
    SYSTEM_1,
    SYSTEM_3,
    approximate_tokens,
    first_prompt,
    make_loaded4,
    run_chain,
    second_prompt,
)
from helpers.client import make_store_engine
from helpers.kv import random_segment
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from helpers.text import CharTokenizer

from kvsplice.agents.template import Placeholder
from kvsplice.client.execute.execution import CallTimings, reuse_map
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source, SubsetRule
from kvsplice.client.model.hf_cache import full_length_cache, read_layers
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.anchor.params import Params as AnchorParams
from kvsplice.client.modes.anchor.policy import AnchorPolicy, agent_key
from kvsplice.client.modes.anchor.pools import (
    anchor_id_of,
    decode_anchor,
    is_agent_output,
    placeholder_id_of,
    sender_base_parent,
)
from kvsplice.client.modes.base import ReusePolicy
from kvsplice.client.modes.blend import BlendPolicy
from kvsplice.client.modes.blend import Params as BlendParams
from kvsplice.client.modes.halo import HaloPolicy
from kvsplice.client.modes.halo import Params as HaloParams
from kvsplice.client.modes.multicut import MulticutPolicy
from kvsplice.client.modes.multicut import Params as MulticutParams
from kvsplice.client.modes.recorder import put_records
from kvsplice.client.modes.shared import question_base
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.client.tiers.segment_io import SpanRecord
from kvsplice.common.keys import context_key, root_key
from kvsplice.index.anchor_pool import AnchorPoolConfig
from kvsplice.kvmath.anchor_payload import encode_offsets, split_offsets
from kvsplice.kvmath.anchors import AgentOffsets
from kvsplice.kvmath.payload import decode_payload
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.server.anchor_service import ID_PATTERN
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

ATOL = 1e-4  # fp32 logits of a plan that computes what dense computes
QUESTIONS = ("what is two plus two?", "name a prime number above ten")
NEAR_DUPLICATE = "what is two plus two!"  # as long as QUESTIONS[0], one character apart
QUESTION_POOL = placeholder_id_of("user_question")


@pytest.fixture(scope="module")
def store_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    lmdb_path = tmp_path_factory.mktemp("approx") / "lmdb"
    with EmbeddedStore(loopback_config(str(lmdb_path))) as store:
        yield store.target


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded4()


@pytest.mark.parametrize(
    ("policy", "num_layers"),
    [
        # blend keeps the old K/V of unselected tokens above the check layer only
        (BlendPolicy(), NUM_LAYERS - 1),
        (HaloPolicy(HaloParams(num_halo=2)), NUM_LAYERS),
        (HaloPolicy(HaloParams(2, epsilon_nats=1e9)), NUM_LAYERS),
    ],
    ids=["blend", "halo", "halo-accepted"],
)
def test_blend_and_halo_reuse_upstream_spans_on_the_second_call(
    loaded: LoadedModel, store_target: str, policy: ReusePolicy, num_layers: int
) -> None:
    namespace = f"approx-reuse-{policy.mode}-{id(policy)}"
    engine = make_store_engine(loaded, policy, store_target, namespace)
    (_, first), (_, second) = run_chain(engine, QUESTIONS[0])
    assert first.output_ids and second.output_ids
    assert approximate_tokens(second) > 0
    approximate = [s for s in second.reused if not s.exact]
    assert {(s.mode, s.num_layers) for s in approximate} == {(policy.mode, num_layers)}
    assert second.ttft_s > second.timings.prefill_s > 0


def test_multicut_reuses_lower_layers_and_stores_boundary_states(
    loaded: LoadedModel, store_target: str
) -> None:
    # the question's left contexts share 17 tokens: cut 3 (needs 16) passes, cut 4 (full) not
    config = MulticutParams(w_exact=((3, 16),), cut_every=1)
    engine = make_store_engine(loaded, MulticutPolicy(config), store_target, "approx-multicut")
    (_, first), (_, second) = run_chain(engine, QUESTIONS[0])
    assert first.num_reused_tokens == 0
    [reused] = second.reused
    assert (reused.name, reused.mode, reused.num_layers) == ("user_question", "multicut", 3)
    assert reused.num_tokens == len(QUESTIONS[0]) and reused.delta == 1  # "plan." vs "solve."
    tokenizer = CharTokenizer()
    system_key = context_key(root_key(loaded.fingerprint), tokenizer.encode(SYSTEM_1))
    question_key = context_key(system_key, tokenizer.encode(QUESTIONS[0]))
    assert engine.store is not None
    found = engine.store.get_segment(question_key)
    assert found is not None
    assert decode_payload(found[1]).boundary_states.keys() == {1, 2, 3}


@pytest.mark.parametrize(
    "policy",
    [
        BlendPolicy(BlendParams(ratio=1.0)),
        HaloPolicy(HaloParams(num_halo=10_000)),
        HaloPolicy(HaloParams(num_halo=2, epsilon_nats=0.0)),
        MulticutPolicy(MulticutParams(w_exact=((0, "full"),), cut_every=1)),
    ],
    ids=["blend-r1", "halo-h-all", "halo-reject", "multicut-full-window"],
)
def test_degenerate_settings_equal_dense(
    loaded: LoadedModel, store_target: str, policy: ReusePolicy
) -> None:
    namespace = f"approx-degenerate-{policy.mode}-{id(policy)}"
    engine = make_store_engine(loaded, policy, store_target, namespace)
    calls = [call for q in QUESTIONS for call in run_chain(engine, q)]
    for prompt, outcome in calls:
        reference = engine.dense_reference(prompt, GENERATION)
        assert outcome.generated_ids == reference.generated_ids
        assert (outcome.logits_first - reference.logits_first).abs().max() <= ATOL
        assert approximate_tokens(outcome) == 0
    assert calls[2][1].num_reused_tokens > 0  # the exact prefix still hits
    if isinstance(policy, HaloPolicy) and policy.params.epsilon_nats is not None:
        assert "rejected" in {o.decisions.get("halo_acceptance") for _, o in calls}


def test_anchor_fills_the_pool_densely_then_reuses_a_near_duplicate(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(loaded, AnchorPolicy(), store_target, "approx-anchor")
    store = engine.store
    assert isinstance(store, StoreClient)
    filling = [call for q in QUESTIONS for call in run_chain(engine, q)]
    assert all(approximate_tokens(outcome) == 0 for _, outcome in filling)
    gates = [o.decisions.get("anchor_gate") for _, o in filling]
    assert set(gates) - {None} <= {"too_few_eligible", "pool_too_small", "ambiguous"}
    pool = store.get_anchors(loaded.fingerprint, QUESTION_POOL)
    assert [e.anchor_id for e in pool] == [
        anchor_id_of(CharTokenizer().encode(q)) for q in QUESTIONS
    ]
    agents = {agent_key(prompt) for prompt, _ in filling}
    assert len(agents) == 2 and all(set(e.agent_payloads) == agents for e in pool)
    (prompt, outcome), _ = run_chain(engine, NEAR_DUPLICATE)
    assert approximate_tokens(outcome) > 0
    assert outcome.decisions == {"anchor_gate": "confident"}
    assert {s.mode for s in outcome.reused if not s.exact} == {"anchor"}
    reference = engine.dense_reference(prompt, GENERATION)
    assert outcome.generated_ids == reference.generated_ids  # measured max |Δlogit| 7e-3
    after = store.get_anchors(loaded.fingerprint, QUESTION_POOL)
    assert len(after) == 2  # the reused sample did not become an anchor
    assert sum(e.activation_count for e in after) > 0


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_anchor_repaired_by_blend_recomputes_its_share(
    loaded: LoadedModel, store_target: str, ratio: float
) -> None:
    # r = 1: every corrected token is recomputed above the check layer, so the
    # call is dense; r = 0.5: half of them keep the correction above it.
    policy = AnchorPolicy(AnchorParams(repair_ratio=ratio))
    plain = AnchorPolicy()
    engine = make_store_engine(loaded, policy, store_target, f"approx-anchor-repair-{ratio}")
    plain_engine = make_store_engine(loaded, plain, store_target, f"approx-anchor-plain-{ratio}")
    for question in QUESTIONS:
        run_chain(engine, question)
        run_chain(plain_engine, question)
    (prompt, outcome), _ = run_chain(engine, NEAR_DUPLICATE)
    (_, unrepaired), _ = run_chain(plain_engine, NEAR_DUPLICATE)
    assert outcome.decisions == unrepaired.decisions == {"anchor_gate": "confident"}
    corrected = approximate_tokens(unrepaired)
    assert corrected > 0
    if ratio == 1.0:
        reference = engine.dense_reference(prompt, GENERATION)
        assert approximate_tokens(outcome) == 0
        assert (outcome.logits_first - reference.logits_first).abs().max() <= ATOL
        assert outcome.generated_ids == reference.generated_ids
    else:
        # blend's floor(M·r) of the M corrected tokens (the last token is never a candidate)
        assert approximate_tokens(outcome) == corrected - corrected // 2


def test_anchor_keeps_decoded_anchors_between_calls(loaded: LoadedModel, store_target: str) -> None:
    # Anchors decoded while the pool filled (each dense call gates again before
    # adding its anchor) are not fetched again, and the correction is the same
    # as with anchors fetched on every call.
    cached = AnchorPolicy()
    uncached = AnchorPolicy(AnchorParams(decoded_cache_bytes=0))
    engine = make_store_engine(loaded, cached, store_target, "approx-anchor-cached")
    reference_engine = make_store_engine(loaded, uncached, store_target, "approx-anchor-uncached")
    for question in QUESTIONS:
        run_chain(engine, question)
        run_chain(reference_engine, question)
    assert cached._decoded.hits == 0
    (_, outcome), _ = run_chain(engine, NEAR_DUPLICATE)
    (_, reference), _ = run_chain(reference_engine, NEAR_DUPLICATE)
    assert outcome.decisions == reference.decisions == {"anchor_gate": "confident"}
    assert cached._decoded.hits > 0
    assert len(uncached._decoded) == 0
    assert torch.equal(outcome.logits_first, reference.logits_first)


def test_anchor_below_full_coverage_corrects_the_covered_first_tokens(
    loaded: LoadedModel, store_target: str
) -> None:
    longer = "how many legs does a spider have?"  # longer than both pooled questions
    length = len(CharTokenizer().encode(longer))
    assert length > max(len(q) for q in QUESTIONS)
    results = {}
    for cover in (1.0, 0.5):
        # γ = 1: the gate never refuses a pool of two, so coverage alone decides
        policy = AnchorPolicy(AnchorParams(gamma=1.0, min_coverage=cover))
        engine = make_store_engine(loaded, policy, store_target, f"approx-anchor-cover-{cover}")
        for question in QUESTIONS:
            run_chain(engine, question)
        (prompt, outcome), _ = run_chain(engine, longer)
        results[cover] = outcome
        if cover < 1:
            reference = engine.dense_reference(prompt, GENERATION)
            kl = torch.nn.functional.kl_div(
                outcome.logits_first.log_softmax(-1), reference.logits_first.log_softmax(-1),
                log_target=True, reduction="sum",
            )  # fmt: skip
            assert float(kl) < 1.0  # an approximation, not noise
    assert results[1.0].decisions == {"anchor_gate": "too_few_eligible"}
    assert approximate_tokens(results[1.0]) == 0
    assert results[0.5].decisions == {"anchor_gate": "confident", "anchor_cover": "partial"}
    # the shorter anchor's length is corrected; the rest and the closing text computed
    assert approximate_tokens(results[0.5]) == min(len(q) for q in QUESTIONS)
    # a minimum coverage above what the pool covers keeps KVComm's rule
    strict = AnchorPolicy(AnchorParams(gamma=1.0, min_coverage=0.9))
    engine = make_store_engine(loaded, strict, store_target, "approx-anchor-cover-strict")
    for question in QUESTIONS:
        run_chain(engine, question)
    (_, outcome), _ = run_chain(engine, longer)
    assert outcome.decisions == {"anchor_gate": "too_few_eligible"}


def test_anchor_with_an_identical_anchor_equals_dense(
    loaded: LoadedModel, store_target: str
) -> None:
    # quant "none": the anchor's base equals the query's, its weight is 1 and
    # base + (real − base) is the real K/V (up to fp32 rounding).
    policy = AnchorPolicy(AnchorParams(quant="none"))
    engine = make_store_engine(loaded, policy, store_target, "approx-anchor-oracle")
    for question in QUESTIONS:
        run_chain(engine, question)
    tokenizer = CharTokenizer()
    system_key = context_key(root_key(loaded.fingerprint), tokenizer.encode(SYSTEM_1))
    assert engine.store is not None  # forget agent 1's question so exact reuse stops before it
    assert engine.store.delete(context_key(system_key, tokenizer.encode(QUESTIONS[0])))
    prompt = first_prompt(QUESTIONS[0])
    outcome = engine.run(prompt, GENERATION)
    reference = engine.dense_reference(prompt, GENERATION)
    # the question and the closing text, less the last token (always computed)
    num_corrected = len(tokenizer.encode(QUESTIONS[0])) + len(tokenizer.encode(CLOSING)) - 1
    assert approximate_tokens(outcome) == num_corrected
    assert (outcome.logits_first - reference.logits_first).abs().max() <= 1e-3
    assert outcome.generated_ids == reference.generated_ids


def test_anchor_offsets_never_serve_another_agent(loaded: LoadedModel, store_target: str) -> None:
    engine = make_store_engine(loaded, AnchorPolicy(), store_target, "approx-anchor-agents")
    for question in QUESTIONS:
        run_chain(engine, question)
    stranger = first_prompt(NEAR_DUPLICATE, system=SYSTEM_3)
    outcome = engine.run(stranger, GENERATION)
    assert approximate_tokens(outcome) == 0  # no anchor holds offsets for this template
    assert isinstance(engine.store, StoreClient)
    entry = engine.store.get_anchors(loaded.fingerprint, QUESTION_POOL)[0]
    first_agent = agent_key(first_prompt("any question"))
    assert len(entry.agent_payloads) == 2
    anchor = decode_anchor(entry, first_agent, fingerprint=loaded.fingerprint, dtype=torch.float32)
    assert anchor is not None and list(anchor.offsets_by_agent) == [first_agent]


def test_anchor_pool_never_exceeds_its_capacity(loaded: LoadedModel) -> None:
    config = loopback_config(None, anchor_pool=AnchorPoolConfig(capacity=2))
    with EmbeddedStore(config) as store:
        engine = make_store_engine(loaded, AnchorPolicy(), store.target, "approx-anchor-capacity")
        client = engine.store
        assert isinstance(client, StoreClient)
        sizes = []
        for question in ("one question", "two questions", "three questions", "four questions"):
            engine.run(first_prompt(question), GENERATION)
            sizes.append(len(client.get_anchors(loaded.fingerprint, QUESTION_POOL)))
        assert sizes == [1, 2, 2, 2]


@pytest.mark.parametrize("mode", ["anchor", "multicut", "blend", "halo"])
def test_unreachable_store_falls_back_to_dense(loaded: LoadedModel, mode: str) -> None:
    config = StoreClientConfig(
        lookup_timeout_s=0.05, get_timeout_s=0.05, put_timeout_s=0.05, max_attempts=1
    )
    dead = StoreClient("127.0.0.1:1", "approx-dead", config=config)
    engine = ReuseEngine(loaded, mode, dead, EngineConfig(quant="none"))
    for prompt, outcome in run_chain(engine, QUESTIONS[0]):
        reference = engine.dense_reference(prompt, GENERATION)
        assert outcome.num_reused_tokens == 0
        assert outcome.generated_ids == reference.generated_ids
    assert dead.counters.num_degraded_calls > 0


@pytest.mark.parametrize("mode", ["anchor", "multicut", "blend", "halo"])
def test_without_store_every_mode_is_dense(loaded: LoadedModel, mode: str) -> None:
    engine = ReuseEngine(loaded, mode, None)
    prompt = first_prompt(QUESTIONS[0])
    outcome, reference = engine.run(prompt, GENERATION), engine.dense_reference(prompt, GENERATION)
    assert outcome.num_reused_tokens == 0 and outcome.generated_ids == reference.generated_ids


def make_offsets(num_placeholder: int, num_next: int, start: int) -> AgentOffsets:
    generator = torch.Generator().manual_seed(num_placeholder * 31 + num_next)
    shape = (NUM_LAYERS, 2, num_placeholder + num_next, 16)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    joined = SegmentKV(keys, values, start_position=start)
    return split_offsets(joined, num_placeholder)


@pytest.mark.parametrize(("num_placeholder", "num_next"), [(5, 0), (5, 3), (1, 7)])
def test_offset_payload_round_trips(
    loaded: LoadedModel, num_placeholder: int, num_next: int
) -> None:
    offsets = make_offsets(num_placeholder, num_next, start=9)
    payload = encode_offsets(offsets, fingerprint=loaded.fingerprint, quant="none")
    back = split_offsets(decode_payload(payload), num_placeholder)
    assert torch.equal(back.placeholder.keys, offsets.placeholder.keys)
    assert back.placeholder.start_position == 9
    if num_next:
        assert back.prefix is not None and offsets.prefix is not None
        assert torch.equal(back.prefix.values, offsets.prefix.values)
        assert back.prefix.start_position == 9 + num_placeholder
    else:
        assert back.prefix is None


def test_ids_are_stable_across_samples_and_valid_store_ids() -> None:
    assert placeholder_id_of("agent_1_history_-1") == "agent.1.history.-1"
    assert anchor_id_of((1, 2, 3)) == anchor_id_of([1, 2, 3]) != anchor_id_of((1, 2, 4))
    same_template = [first_prompt(q) for q in QUESTIONS]
    assert agent_key(same_template[0]) == agent_key(same_template[1])
    assert agent_key(first_prompt("q", system=SYSTEM_3)) != agent_key(same_template[0])
    ids = [placeholder_id_of("user_question"), anchor_id_of((5,)), agent_key(same_template[0])]
    assert all(ID_PATTERN.match(i) for i in ids)


def test_reuse_map_counts_the_layers_each_token_reused() -> None:
    exact, chunk, lower = (
        random_segment(4, 3, 0),
        random_segment(4, 5, 40),
        random_segment(4, 2, 70),
    )
    spans = (
        PlanSpan(0, 3, 4, exact, name="exact@0",
                 source=Source("exact", True, 0, 0, b"k" * 16, 3)),
        PlanSpan(3, 8, 0, chunk, name="blend@3", delta=-37,
                 source=Source("blend", False, 3, -37)),
        PlanSpan(8, 10, 2, SegmentKV(lower.keys[:2], lower.values[:2], 70), torch.zeros(2, 64),
                 "cut@8", -62,
                 Source("multicut", False, 8, -62)),
        PlanSpan(10, 11, name="computed"),
    )  # fmt: skip
    rule = SubsetRule(1, lambda layer, new, old: torch.tensor([2]))  # keeps chunk slot 5
    plan = CallPlan(tuple(range(11)), spans, subsets=(rule,))
    view = reuse_map(plan, num_layers=4, kept_slots={1: (5, 8, 9, 10)})
    got = [
        (s.start, s.end, s.layers[0], s.num_layers, s.source.delta)
        if s.source is not None
        else (s.start, s.end)
        for s in view.ranges
    ]
    assert got == [
        (0, 3, 0, 4, 0),
        (3, 5, 1, 3, -37),  # dropped at the check layer: old K/V from layer 1 on
        (5, 6),  # selected: computed through every layer
        (6, 8, 1, 3, -37),
        (8, 10, 0, 2, -62),  # multicut: layers below the cut
        (10, 11),
    ]
    assert view.ranges[0].source.chain_key == b"k" * 16  # type: ignore[union-attr]
    assert view.num_reused_tokens == 9


def test_a_base_after_a_lead_is_that_prefills_slice_and_is_fetched_later(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(loaded, AnchorPolicy(), store_target, "approx-base-lead")
    lead, tokens = (5, 6, 7), (10, 11, 12, 13)
    ctx = engine._context(CallTimings())
    computed: list[SpanRecord] = []
    base = question_base(tokens, ctx, computed, lead)
    cache = full_length_cache()
    engine.executor.forward((*lead, *tokens), 0, cache)
    keys, values = read_layers(cache, len(lead), len(lead) + len(tokens))
    assert isinstance(base, SegmentKV) and base.start_position == len(lead)  # computed
    assert torch.equal(base.keys, keys) and torch.equal(base.values, values)
    assert put_records(ctx, computed) == 1
    later: list[SpanRecord] = []
    fetched = question_base(tokens, ctx, later, lead)
    assert later == [] and fetched is not None
    assert torch.equal(fetched.decode().values, values)
    alone = question_base(tokens, ctx, later, ())  # another key: no lead, computed at position 0
    assert isinstance(alone, SegmentKV) and alone.start_position == 0 and len(later) == 1
    assert not torch.allclose(alone.values[1:], values[1:])  # the lead changes every layer > 0


def test_an_answers_anchor_base_is_its_senders_kv(loaded: LoadedModel, store_target: str) -> None:
    """KVComm's base of `agent_*` placeholders: the K/V the sender computed for its answer."""
    engine = make_store_engine(
        loaded, AnchorPolicy(AnchorParams(quant="none")), store_target, "sender"
    )
    prompt_1 = first_prompt(QUESTIONS[0])
    first = engine.run(prompt_1, GENERATION)
    assert first.output_ids, "the sender must answer something"
    assert engine.store is not None
    key = context_key(sender_base_parent(loaded.fingerprint), first.output_ids)
    found = engine.store.get_segment(key, model_fingerprint=loaded.fingerprint)
    assert found is not None
    stored = decode_payload(found[1])
    # the sender's own K/V of its answer: dense prefill of prompt + answer, sliced
    full = (*prompt_1.token_ids, *first.output_ids)
    cache = full_length_cache()
    engine.executor.forward(full, 0, cache)
    keys, values = read_layers(cache, len(prompt_1.token_ids), len(full) - 1)
    num = len(first.output_ids) - 1  # the last answer token's K/V is never computed
    assert stored.start_position == len(prompt_1.token_ids)
    assert torch.allclose(stored.values[:, :, :num], values, atol=1e-4)
    assert torch.allclose(stored.keys[:, :, :num], keys, atol=1e-4)
    # the receiver pools an anchor for the answer
    prompt_2 = second_prompt(QUESTIONS[0], first.output_ids)
    engine.run(prompt_2, GENERATION)
    answers = engine.store.get_anchors(loaded.fingerprint, placeholder_id_of("agent_1_current"))
    assert [e.anchor_id for e in answers] == [anchor_id_of(first.output_ids)]
    assert agent_key(prompt_2) in answers[0].agent_ids


def test_agent_output_names_match_the_template_grammar() -> None:
    for name in (
        "agent_1_current",
        "agent_planner_history_-1",
        "user_question",
        "condition_a_current",
    ):
        assert is_agent_output(name) == Placeholder.parse(name).is_agent_output
