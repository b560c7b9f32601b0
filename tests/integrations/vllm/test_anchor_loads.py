"""The anchor mode at load, against oracles: corrected K/V equal to the in-context K/V.

A sender stored runs A and B (computed at OLD, in its own context). An engine computed
them in a context C (at NEW: the moved base plus an offset of C's) and made their
anchors (`AnchorSaver`). The oracles: a request loading A in C in the anchor mode gets
C's K/V of A (the anchor is the run itself); a run A' near A gets K/V closer to its own
in-context K/V than naive's moved base. Each oracle runs against two broken corrections
(offsets with their sign flipped; anchors ignored, i.e. naive) that must fail it. The gate
refuses with no pool or an ambiguous one: nothing is written, the blocks are recomputed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers.vllm_worker import BLOCK, DIM, FINGERPRINT, HEADS, LAYERS, NS, FakeStore, make_worker

from kvsplice.common.errors import FingerprintMismatch
from kvsplice.common.keys import root_key
from kvsplice.common.reuse_modes import ANCHOR
from kvsplice.common.segment import chained_meta
from kvsplice.integrations.vllm import anchor_loads, anchor_saves
from kvsplice.integrations.vllm.anchor_loads import AnchorGate
from kvsplice.integrations.vllm.chunk_putter import token_major
from kvsplice.integrations.vllm.reuse_policy import mode_params
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.transfer_specs import AnchorSpec, LoadSpec
from kvsplice.integrations.vllm.worker_side import WorkerSide
from kvsplice.kvmath.payload import encode_payload
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.results import AnchorEntry

ROPE = RopeSpec.uniform(DIM, 10_000.0, LAYERS)
OLD, NEW, T = 4, 8, 2 * BLOCK  # where runs were computed and are loaded; their length
PREFIX = (7,) * NEW  # the context C the runs land in
BLOCKS = (2, 3)  # where an engine computed a run (tokens NEW..NEW+T)
BROKEN = [None, "sign-flipped", "anchors-ignored"]


class AnchorStore(FakeStore):
    """A fake sidecar that also keeps anchor pools (one base, offsets per agent)."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: dict[tuple[str, str], dict[str, AnchorEntry]] = {}
        self.touched = 0

    def put_anchor(
        self, fingerprint: str, pool_id: str, anchor_id: str, base: bytes,
        agent_payloads: dict[str, bytes], num_tokens: int,
    ) -> list[str]:  # fmt: skip
        pool = self.pools.setdefault((fingerprint, pool_id), {})
        old = pool.get(anchor_id)
        payloads = {**(old.agent_payloads if old else {}), **agent_payloads}
        pool[anchor_id] = AnchorEntry(anchor_id, num_tokens, 0, len(pool) + 1, base, payloads,
                                      tuple(sorted(payloads)))  # fmt: skip
        return []

    def get_anchors(
        self, fingerprint: str, pool_id: str, *, include_payloads: bool = True,
        anchor_ids: tuple[str, ...] = (), agent_id: str | None = None,
    ) -> list[AnchorEntry]:  # fmt: skip
        entries = self.pools.get((fingerprint, pool_id), {}).values()
        found = []
        for e in entries:
            if anchor_ids and e.anchor_id not in anchor_ids:
                continue
            payloads = {a: p for a, p in e.agent_payloads.items() if agent_id in (None, a)}
            found.append(AnchorEntry(
                e.anchor_id, e.num_tokens, 0, e.created_seq,
                e.base_payload if include_payloads else b"",
                payloads if include_payloads else {}, e.agent_ids,
            ))  # fmt: skip
        return found


def at(states: torch.Tensor, start: int) -> torch.Tensor:
    """Pre-RoPE states [L, H, T, D] rotated to positions start.. ."""
    return ROPE.shift_layers(states, torch.arange(start, start + states.shape[2]))


def offset_of(seed: int, scale: float = 0.3) -> torch.Tensor:
    """A context's offset [L, H, T, D]: nothing at layer 0 (it depends on the token alone)."""
    offset = scale * torch.randn(
        LAYERS, HEADS, T, DIM, generator=torch.Generator().manual_seed(seed)
    )
    offset[0] = 0
    return offset


class Run:
    """A run as its sender stored it, and as context C computes it (`real`)."""

    def __init__(self, store: AnchorStore, tokens: tuple[int, ...], states: torch.Tensor,
                 values: torch.Tensor, offset: torch.Tensor) -> None:  # fmt: skip
        meta = chained_meta(NS, FINGERPRINT, root_key(FINGERPRINT), tokens, OLD, LAYERS,
                            created_at_s=time.time(), exact=True)  # fmt: skip
        stored = SegmentKV(at(states, OLD), values, start_position=OLD)
        store.put_segment(meta, encode_payload(stored, model_fingerprint=FINGERPRINT, quant="none"))
        self.tokens = tokens
        self.span = ReusedSpan(meta.segment_id, NEW, T, 0, OLD)
        self.naive = SegmentKV(at(states, NEW), values, start_position=NEW)
        self.real = SegmentKV(self.naive.keys + offset, values + offset, start_position=NEW)


def make_run(store: AnchorStore, first_token: int, seed: int, offset: torch.Tensor) -> Run:
    gen = torch.Generator().manual_seed(seed)
    states, values = (torch.randn(LAYERS, HEADS, T, DIM, generator=gen) for _ in range(2))
    return Run(store, tuple(range(first_token, first_token + T)), states, values, offset)


def anchor_of(worker: WorkerSide, run: Run) -> None:
    """An engine computed `run` in context C (its blocks hold `run.real`): make its anchor."""
    worker.paged.scatter(BLOCKS, run.real.keys, run.real.values)
    worker.save_anchors(AnchorSpec("w", NS, FINGERPRINT, PREFIX + run.tokens, (run.span,),
                                   BLOCKS, BLOCK))  # fmt: skip
    assert worker.anchor_saves is not None and worker.anchor_saves.flush()


def load(
    store: AnchorStore, run: Run, gate: AnchorGate | None = None
) -> tuple[set[int], SegmentKV, WorkerSide]:
    """Load `run` in C in the anchor mode into blocks 5, 6: failed blocks and what they hold."""
    reader = make_worker(store, seed=None, rope=ROPE, anchor_gate=gate)
    spec = LoadSpec("r", NS, FINGERPRINT, NEW, NEW + T, (5, 6), PREFIX + run.tokens, (),
                    spans=(run.span,), mode="anchor")  # fmt: skip
    failed = reader.load(spec)
    blocks = reader.paged.copy_out((5, 6))
    return failed, token_major(blocks, reader.paged.layout, NEW), reader


def error(kv: SegmentKV, real: SegmentKV) -> float:
    return float(((kv.keys - real.keys).norm() + (kv.values - real.values).norm()) / 2)


def break_correction(monkeypatch: pytest.MonkeyPatch, broken: str | None) -> None:
    if broken == "sign-flipped":  # anchors made with base − in-context as their offsets
        real_offset = anchor_saves.kv_offset
        monkeypatch.setattr(
            anchor_saves, "kv_offset", lambda r, b, rope: _negated(real_offset(r, b, rope))
        )
    elif broken == "anchors-ignored":  # the correction returns the base: naive

        def naive(query, anchors, rope, tau):  # type: ignore[no-untyped-def]
            return type("C", (), {"placeholder": query.base})()

        monkeypatch.setattr(anchor_loads, "correct", naive)


def _negated(kv: SegmentKV) -> SegmentKV:
    return SegmentKV(-kv.keys, -kv.values, kv.start_position, kv.layer_start)


def two_anchors(store: AnchorStore) -> tuple[Run, Run]:
    maker = make_worker(store, seed=None, rope=ROPE)
    a, b = make_run(store, 300, 1, offset_of(11)), make_run(store, 400, 2, offset_of(12))
    anchor_of(maker, a)
    anchor_of(maker, b)
    return a, b


@pytest.mark.parametrize("broken", BROKEN)
def test_a_run_whose_anchor_is_itself_loads_its_in_context_kv(
    broken: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_correction(monkeypatch, broken)
    store = AnchorStore()
    a, _ = two_anchors(store)
    failed, loaded, _ = load(store, a)
    assert failed == set()
    assert error(a.naive, a.real) > 1.0  # naive alone is far off: the oracle can fail
    assert (error(loaded, a.real) < 1e-4) == (broken is None), error(loaded, a.real)


@pytest.mark.parametrize("broken", BROKEN)
def test_a_run_near_an_anchor_loads_closer_to_its_in_context_kv_than_naive(
    broken: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A' has A's base plus 5% noise and C's offset of A plus 10% noise: the correction
    must land at most half naive's error from A''s in-context K/V."""
    break_correction(monkeypatch, broken)
    store = AnchorStore()
    near = near_a(store)
    failed, loaded, _ = load(store, near)
    assert failed == set()
    assert (error(loaded, near.real) < 0.5 * error(near.naive, near.real)) == (broken is None)


def near_a(store: AnchorStore) -> Run:
    """A run A' near anchor A (two anchors stored): A's base plus 5% noise, C's offset of A
    plus a little of another."""
    a, _ = two_anchors(store)
    gen = torch.Generator().manual_seed(5)
    states = ROPE.shift_layers(a.naive.keys, -NEW) + 0.05 * torch.randn(
        a.naive.keys.shape, generator=gen
    )
    values = a.naive.values + 0.05 * torch.randn(a.naive.values.shape, generator=gen)
    return Run(store, tuple(range(500, 500 + T)), states, values,
               offset_of(11) + offset_of(13, scale=0.03))  # fmt: skip


def test_with_too_few_anchors_the_gate_refuses_and_nothing_is_written() -> None:
    """KVComm's gate wants two anchors: with none, then one, the run is refused (its blocks
    recomputed, a refusal in the news, not a failed load); once the context has two, loaded."""
    store = AnchorStore()
    maker = make_worker(store, seed=None, rope=ROPE)
    a, b = make_run(store, 300, 1, offset_of(11)), make_run(store, 400, 2, offset_of(12))
    for made, want in ((0, "0 stored anchor(s)"), (1, "1 stored anchor(s)")):
        if made:
            anchor_of(maker, a)
        failed, loaded, reader = load(store, b)
        assert failed == {5, 6} and reader.num_failed_loads == 0
        (fault,) = reader.take_news(0).faults
        assert fault.refusal is not None and want in fault.refusal and fault.position == NEW
        assert float(loaded.keys.abs().max()) == 0.0  # nothing written
    anchor_of(maker, b)
    failed, loaded, _ = load(store, b)
    assert failed == set() and error(loaded, b.real) < 1e-4


def test_an_ambiguous_pool_is_refused() -> None:
    """A query midway between two anchors' bases: equal weights, H = 1 bit > γ·log2(2)."""
    store = AnchorStore()
    a, b = two_anchors(store)
    states = (ROPE.shift_layers(a.naive.keys, -NEW) + ROPE.shift_layers(b.naive.keys, -NEW)) / 2
    values = (a.naive.values + b.naive.values) / 2
    middle = Run(store, tuple(range(600, 600 + T)), states, values, offset_of(14))
    failed, _, reader = load(store, middle)
    assert failed == {5, 6}
    (fault,) = reader.take_news(0).faults
    assert fault.refusal is not None and fault.refusal.startswith("ambiguous")


def policy_file(tmp_path: Path, params: dict[str, object], modes: tuple[str, ...]) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({
        "format_version": 2, "model_fingerprint": FINGERPRINT, "created_at": None,
        "admitted_modes": ["dense", "exact", *modes], "drift": {}, "params": {"anchor": params},
    }))  # fmt: skip
    return str(path)


@pytest.mark.parametrize("gamma", [None, 0.0])
def test_the_gate_runs_with_the_gamma_the_policy_calibrated(
    gamma: float | None, tmp_path: Path
) -> None:
    """A' near A is corrected at the default γ (0.3); a policy that calibrated γ = 0 (any
    uncertainty refuses) gets it refused: the policy's parameter reaches the gate."""
    params = {} if gamma is None else {"gamma": gamma, "tau": 0.1, "metric": "value"}
    gate = AnchorGate.from_policy(*mode_params(policy_file(tmp_path, params, ("anchor",)),
                                               FINGERPRINT, ANCHOR))  # fmt: skip
    store = AnchorStore()
    failed, _, reader = load(store, near_a(store), gate)
    if gamma is None:
        assert gate == AnchorGate() and failed == set()
    else:
        assert gate.gamma == 0.0 and failed == {5, 6}
        (fault,) = reader.take_news(0).faults
        assert fault.refusal is not None and fault.refusal.startswith("ambiguous")


def test_a_policy_not_admitting_anchor_or_for_another_model_gives_no_gate_params(
    tmp_path: Path,
) -> None:
    path = policy_file(tmp_path, {"gamma": 0.0}, ("naive",))
    assert mode_params(path, FINGERPRINT, ANCHOR)[0] == {}
    assert mode_params(None, "kvfp1-" + "0" * 32, ANCHOR) == ({}, "no admission policy")
    with pytest.raises(FingerprintMismatch):
        mode_params(path, "kvfp1-" + "1" * 32, ANCHOR)


@pytest.mark.parametrize("unrun", [{"repair_ratio": 0.15}, {"min_coverage": 0.5},
                                   {"pool_judges": 1}, {"metric": "hidden"}])  # fmt: skip
def test_a_policy_calibrated_with_what_the_connector_does_not_run_is_refused(
    unrun: dict[str, object], tmp_path: Path
) -> None:
    path = policy_file(tmp_path, {"gamma": 0.5, **unrun}, ("anchor",))
    with pytest.raises(ValueError, match=next(iter(unrun))):
        AnchorGate.from_policy(*mode_params(path, FINGERPRINT, ANCHOR))
    # its storage details (the HF loop's own payload scheme) are not the gate's: accepted
    kept = {"gamma": 0.5, "repair_ratio": None, "quant": "int8", "max_anchor_nbytes": 1 << 20}
    assert AnchorGate.from_policy(kept, "p").gamma == 0.5
