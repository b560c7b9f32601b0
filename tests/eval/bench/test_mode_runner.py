"""The measurement protocol on a tiny random model with a real embedded store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.evaluation import ToyWorkload, make_tiny_loaded, use_one_torch_thread

from kvsplice.client.model.models import LoadedModel
from kvsplice.eval.bench.mode_runner import ModeRunConfig, ProgressEvent, run_modes
from kvsplice.eval.bench.store_session import StoreSession, namespace_stats, open_store
from kvsplice.eval.measure.metrics import CallRecord, aggregate


@pytest.fixture(scope="module")
def store() -> Iterator[StoreSession]:
    with open_store(None) as session:
        yield session


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    use_one_torch_thread()
    return make_tiny_loaded()


CONFIG = ModeRunConfig(
    modes=("exact", "naive", "dense"), num_agents=2, max_new_tokens=3, namespace="runner-test"
)


@pytest.fixture(scope="module")
def run(loaded: LoadedModel, store: StoreSession) -> tuple[list[CallRecord], list[ProgressEvent]]:
    events: list[ProgressEvent] = []
    workload = ToyWorkload()
    records = run_modes(loaded, workload, workload.problems(2), CONFIG, store.target, events.append)
    return records, events


VARIANTS = ModeRunConfig(
    modes=("dense", "naive", "halo:h=2", "blend:r=0.5"), num_agents=2, max_new_tokens=2,
    reference="first_token", warmup=False, namespace="runner-variants",
)  # fmt: skip


@pytest.fixture(scope="module")
def variant_run(loaded: LoadedModel, store: StoreSession) -> list[CallRecord]:
    workload = ToyWorkload()
    return run_modes(loaded, workload, workload.problems(1), VARIANTS, store.target)


def test_config_puts_dense_first_and_requires_it() -> None:
    assert CONFIG.modes == ("dense", "exact", "naive")
    with pytest.raises(ValueError, match="dense"):
        ModeRunConfig(modes=("exact",))
    with pytest.raises(ValueError, match="graph"):
        ModeRunConfig(graph="star")


def test_config_keeps_variant_labels_and_rejects_duplicate_ones() -> None:
    config = ModeRunConfig(modes=("halo:eps=0.05+h=4", "dense", "multicut:cut=16"))
    assert config.modes == ("dense", "halo:h=4+eps=0.05", "multicut:cut=16")
    assert [v.label for v in config.variants] == list(config.modes)
    with pytest.raises(ValueError, match="distinct"):
        ModeRunConfig(modes=("dense", "blend:r=0.5", "blend:r=.50"))
    with pytest.raises(ValueError, match="unknown parameter"):
        ModeRunConfig(modes=("dense", "blend:h=4"))
    with pytest.raises(ValueError, match="namespace"):
        ModeRunConfig(modes=("dense", "blend:r=0.5"), namespace="n" * 118)


def test_each_variant_gets_a_namespace_of_its_own() -> None:
    config = ModeRunConfig(modes=("dense", "halo:h=4", "halo:h=4+eps=0.05", "halo:h=16"))
    namespaces = [config.namespace_of(mode) for mode in config.modes]
    assert namespaces[2] == "kvsplice-eval-halo:h_4:eps_0.05"
    assert len(set(namespaces)) == len(namespaces)


def test_records_carry_variant_labels_and_layer_counts(variant_run) -> None:
    assert [(r.mode, r.position) for r in variant_run] == [
        (m, p) for m in ("dense", "naive", "halo:h=2", "blend:r=0.5") for p in (1, 2)
    ]
    assert {r.num_layers for r in variant_run} == {2}  # the tiny model's depth


def test_naive_reuses_every_layer_of_what_it_reuses(variant_run) -> None:
    naive = [r for r in variant_run if r.mode == "naive" and r.position == 2]
    assert naive and naive[0].num_reused_tokens > 0
    assert naive[0].num_reused_token_layers == 2 * naive[0].num_reused_tokens
    stats = aggregate(variant_run).at("naive", 2)
    assert stats is not None and stats.token_layer_reuse_rate == pytest.approx(
        stats.token_reuse_rate
    )


def test_one_record_per_call_modes_interleaved_per_sample(run) -> None:
    records, _ = run
    order = [(r.sample_index, r.mode, r.position) for r in records]
    expected = [(s, m, p) for s in (0, 1) for m in ("dense", "exact", "naive") for p in (1, 2)]
    assert order == expected
    assert all(r.ttft_s > 0 and r.num_output_tokens == 3 for r in records)


def test_exact_equals_dense_and_dense_is_its_own_reference(run) -> None:
    records, _ = run
    for record in records:
        if record.mode in ("dense", "exact"):
            assert record.first_token_agrees and record.output_matches, record
            assert record.kl_dense_reuse == pytest.approx(0.0, abs=1e-9)
    naive = [r for r in records if r.mode == "naive"]
    assert all(r.kl_dense_reuse is not None and r.output_matches is not None for r in naive)


def test_reuse_happens_where_it_is_possible(run) -> None:
    records, _ = run
    reused = {(r.mode, r.sample_index, r.position): r.num_reused_tokens for r in records}
    assert all(v == 0 for (mode, _, _), v in reused.items() if mode == "dense")
    assert reused[("exact", 0, 1)] == 0  # a fresh namespace: nothing to hit yet
    assert reused[("exact", 1, 1)] > 0  # the template prefix of sample 0
    assert reused[("naive", 0, 2)] > 0  # agent 1's answer and the question base


def test_only_final_calls_are_scored(run) -> None:
    records, _ = run
    assert [r.correct is not None for r in records] == [r.position == 2 for r in records]


def test_each_mode_has_its_own_namespace_and_warmup_stays_apart(run, store: StoreSession) -> None:
    stats = namespace_stats(store.target, [
        CONFIG.namespace_of("dense"), CONFIG.namespace_of("exact"),
        CONFIG.namespace_of("exact", warmup=True), CONFIG.namespace_of("naive"),
    ])  # fmt: skip
    counts = {ns: 0 if s is None else s.num_segments for ns, s in stats.items()}
    assert counts[CONFIG.namespace_of("dense")] == 0  # dense never stores
    assert counts[CONFIG.namespace_of("exact")] > 0
    assert counts[CONFIG.namespace_of("exact", warmup=True)] > 0
    assert counts[CONFIG.namespace_of("naive")] > 0


def test_progress_counts_every_call_including_warmup(run) -> None:
    _, events = run
    total = 2 * 3 * (2 + 1)  # agents x modes x (samples + warm-up)
    assert [e.done for e in events] == list(range(1, total + 1))
    assert {e.total for e in events} == {total}
    assert events[0].message.startswith("warm-up")
