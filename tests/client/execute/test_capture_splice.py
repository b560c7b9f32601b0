"""Capture and executor splice oracles on tiny random Llama / Gemma3 models (fast)."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.model import make_prompt, make_tiny_gemma3, make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from kvsplice.client.execute.call_executor import CallExecutor
from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.execution import CallTimings, ExecutionState, GenerationConfig
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source
from kvsplice.client.model.models import kv_layout
from kvsplice.common.errors import LayoutMismatch
from kvsplice.kvmath.payload import KVSource, decode_payload, decode_stored, encode_payload
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

FINGERPRINT = "kvfp1-" + "0" * 32
LLAMA = make_tiny_llama()
GEMMA3 = make_tiny_gemma3(sliding_window=4)


def make_spliced(model: PreTrainedModel, ids: list[int], cuts: list[int]) -> list[SegmentKV]:
    """Segments for ids[cuts[i]:cuts[i+1]], all cut from one dense pass over ids[:cuts[-1]]."""
    spans = list(itertools.pairwise(cuts))
    return capture_segments(model, ids[: cuts[-1]], spans).segments


def through_payload(segment: SegmentKV) -> SegmentKV:
    data = encode_payload(segment, model_fingerprint=FINGERPRINT, quant="none")
    return decode_payload(data, expect_fingerprint=FINGERPRINT)


def make_executor(model: PreTrainedModel) -> CallExecutor:
    return CallExecutor(model, kv_layout(model), RopeSpec.from_hf_config(model.config))


def run(model: PreTrainedModel, ids: list[int], segments: list[KVSource], num_new: int = 1):
    """The executor over `ids` with `segments` (tensors or stored) back to back from slot 0,
    every layer read (dense if none)."""
    spans, start = [], 0
    for segment in segments:
        delta = start - segment.start_position
        source = Source("exact", True, start, delta)
        end = start + segment.num_tokens
        spans.append(PlanSpan(start, end, segment.num_layers, segment, delta=delta, source=source))
        start = end
    executor = make_executor(model)
    state = executor.prefill(CallPlan.tiled(ids, spans), CallTimings())
    executor.generate(state, GenerationConfig(num_new, ignore_stop=True), CallTimings())
    return state


def logits_delta(a: ExecutionState, b: ExecutionState) -> float:
    return float((a.logits_first - b.logits_first).abs().max())


def test_spans_from_one_pass_are_slices_of_the_full_capture() -> None:
    ids = make_prompt(24)
    whole = capture_segments(LLAMA, ids, [(0, 24)], position_offset=5).segments[0]
    parts = capture_segments(LLAMA, ids, [(0, 7), (7, 20), (20, 24)], position_offset=5).segments
    assert [p.start_position for p in parts] == [5, 12, 25]
    for part, (a, b) in zip(parts, [(0, 7), (7, 20), (20, 24)], strict=True):
        assert torch.equal(part.keys, whole.keys[:, :, a:b])
        assert torch.equal(part.values, whole.values[:, :, a:b])


def test_capture_logits_equal_a_plain_forward() -> None:
    ids = make_prompt(16)
    capture = capture_segments(LLAMA, ids, [(0, 16)])
    with torch.inference_mode():
        reference = LLAMA(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(capture.logits_last, reference, atol=1e-6, rtol=0)


def test_boundary_states_match_hf_hidden_states_and_last_is_pre_norm() -> None:
    ids = make_prompt(12)
    num_layers = LLAMA.config.num_hidden_layers
    segment = capture_segments(
        LLAMA, ids, [(3, 9)], boundary_layers=range(num_layers + 1)
    ).segments[0]
    with torch.inference_mode():
        hidden = LLAMA(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in range(num_layers):  # hidden_states[l] is the input of decoder layer l
        assert torch.equal(segment.boundary_states[layer], hidden[layer][0, 3:9])
    # In transformers v5 the last hidden state is after the final norm; ours is before it.
    with torch.inference_mode():
        normed = LLAMA.model.norm(segment.boundary_states[num_layers])
    torch.testing.assert_close(normed, hidden[-1][0, 3:9], atol=1e-6, rtol=0)


def test_sliding_window_layers_are_captured_at_full_length() -> None:
    ids = make_prompt(12)
    segment = capture_segments(GEMMA3, ids, [(0, 12)]).segments[0]
    assert segment.keys.shape == (3, 2, 12, 16)
    assert bool(segment.keys[:2, :, :4].abs().sum() > 0)  # early tokens kept in sliding layers


def test_dense_prefill_equals_a_plain_forward() -> None:
    ids = make_prompt(20)
    with torch.inference_mode():
        reference = LLAMA(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(run(LLAMA, ids, []).logits_first, reference, atol=1e-6, rtol=0)


@settings(max_examples=8, deadline=None)
@given(
    num_tokens=st.integers(2, 40),
    data=st.data(),
)
def test_exact_splice_through_payload_equals_dense(num_tokens: int, data: st.DataObject) -> None:
    ids = make_prompt(num_tokens, seed=num_tokens)
    prefix = data.draw(st.integers(1, num_tokens - 1), label="prefix")
    inner = data.draw(st.lists(st.integers(1, prefix), max_size=3, unique=True), label="cuts")
    cuts = sorted({0, prefix, *inner})
    segments = [through_payload(s) for s in make_spliced(LLAMA, ids, cuts)]
    spliced, dense = run(LLAMA, ids, segments, 4), run(LLAMA, ids, [], 4)
    assert spliced.reuse.num_reused_tokens == prefix
    assert logits_delta(spliced, dense) <= 1e-5
    assert spliced.generated == dense.generated


@pytest.mark.parametrize("prefix", [2, 3, 4, 5, 11, 19])
def test_exact_splice_into_sliding_window_layers_equals_dense(prefix: int) -> None:
    ids = make_prompt(20, seed=3)
    segments = make_spliced(GEMMA3, ids, [0, prefix])
    spliced, dense = run(GEMMA3, ids, segments, 8), run(GEMMA3, ids, [], 8)
    assert logits_delta(spliced, dense) <= 1e-5
    assert spliced.generated == dense.generated


@pytest.mark.parametrize("model", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
def test_segment_captured_at_another_position_is_shifted_into_place(model: PreTrainedModel) -> None:
    ids = make_prompt(30, seed=5)
    moved = capture_segments(model, ids[:18], [(0, 18)], position_offset=300).segments[0]
    spliced, dense = run(model, ids, [moved]), run(model, ids, [])
    # fp32 RoPE angles round differently at positions p and p + 300 (~|p·θ|·2^-24).
    assert logits_delta(spliced, dense) <= 1e-4
    stored = decode_stored(encode_payload(moved, model_fingerprint=FINGERPRINT, quant="none"))
    assert logits_delta(run(model, ids, [stored]), spliced) == 0.0  # read in place, bit-exact


@pytest.mark.parametrize("model", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
def test_stored_int8_segments_splice_like_their_decoded_form(model: PreTrainedModel) -> None:
    """The fused path (dequantize + shift + write in place) builds the cache that
    decoding first and shifting after builds, mixed with decoded segments too."""
    ids = make_prompt(30, seed=6)
    moved = capture_segments(model, ids[:12], [(0, 12)], position_offset=200).segments[0]
    rest = capture_segments(model, ids[12:18], [(0, 6)], position_offset=7).segments[0]
    payloads = [
        encode_payload(s, model_fingerprint=FINGERPRINT, quant="int8") for s in (moved, rest)
    ]
    decoded: list[KVSource] = [decode_payload(payload) for payload in payloads]
    stored = [decode_stored(payloads[0]), decoded[1]]
    from_decoded, from_stored = run(model, ids, decoded), run(model, ids, stored)
    for fused, reference in zip(from_stored.cache.layers, from_decoded.cache.layers, strict=True):
        # Spliced tokens: values bit-equal, keys within fp32 rounding of the shift.
        torch.testing.assert_close(
            fused.keys[..., :18, :], reference.keys[..., :18, :], atol=2e-5, rtol=0
        )
        assert torch.equal(fused.values[..., :18, :], reference.values[..., :18, :])
    assert logits_delta(from_stored, from_decoded) <= 1e-4
    # the decoder-layer loop writes stored segments into its buffer the same way
    plan = CallPlan.tiled(ids, [PlanSpan(0, 12, stored[0].num_layers, stored[0], delta=-200)])
    looped = make_executor(model).layerwise.run(plan)
    spliced = run(model, ids, stored[:1])
    assert float((looped.logits_last - spliced.logits_first).abs().max()) <= 1e-4


def test_the_splice_lays_segments_back_to_back() -> None:
    ids = make_prompt(16)
    captured = capture_segments(LLAMA, ids, [(0, 10)]).segments[0]
    cache = run(LLAMA, ids, [captured]).cache
    assert cache.get_seq_length() == 16
    assert torch.equal(cache.layers[1].keys[0, :, :10], captured.keys[1])


def test_standalone_segments_are_shifted_to_their_targets() -> None:
    # Layer-0 keys depend only on token and position, so after placement they must
    # equal the layer-0 keys of a dense pass over the concatenation.
    ids = make_prompt(20)
    first = capture_segments(LLAMA, ids[:8], [(0, 8)], position_offset=40).segments[0]
    second = capture_segments(LLAMA, ids[8:], [(0, 12)]).segments[0]
    cache = run(LLAMA, ids, [first, second]).cache
    dense = capture_segments(LLAMA, ids, [(0, 20)]).segments[0]
    assert cache.get_seq_length() == 20
    torch.testing.assert_close(cache.layers[0].keys[0], dense.keys[0], atol=1e-5, rtol=0)


def test_segments_covering_the_whole_prompt_leave_the_last_token_computed() -> None:
    ids = make_prompt(12)
    state = run(LLAMA, ids, make_spliced(LLAMA, ids, [0, 12]))
    assert state.reuse.num_reused_tokens == 11
    assert logits_delta(state, run(LLAMA, ids, [])) <= 1e-5


def test_partial_depth_or_foreign_geometry_is_a_layout_mismatch() -> None:
    ids = make_prompt(8)
    full = make_spliced(LLAMA, ids, [0, 4])[0]
    shallow = SegmentKV(full.keys[:1], full.values[:1], 0)
    wide = SegmentKV(torch.zeros(2, 3, 4, 16), torch.zeros(2, 3, 4, 16), 0)
    for segment, match in ((shallow, "layers"), (wide, "heads")):
        with pytest.raises(LayoutMismatch, match=match):
            run(LLAMA, ids, [segment])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stored_segments_splice_on_cuda_through_pinned_staging() -> None:
    """int8 bytes cross once (pinned, non-blocking), then dequantize + shift on the GPU."""
    model = make_tiny_llama().cuda()
    ids = make_prompt(24, seed=8)
    moved = capture_segments(LLAMA, ids[:16], [(0, 16)], position_offset=64).segments[0]
    payload = encode_payload(moved, model_fingerprint=FINGERPRINT, quant="int8")
    on_gpu = run(model, ids, [decode_stored(payload)])
    on_cpu = run(LLAMA, ids, [decode_stored(payload)])
    assert on_gpu.cache.layers[0].keys.device.type == "cuda"
    torch.testing.assert_close(on_gpu.logits_first.cpu(), on_cpu.logits_first, atol=1e-3, rtol=0)
