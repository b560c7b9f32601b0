"""Factories for the reuse-mode tests: a tiny random Llama, prompts, captures, an agent scene."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.plan import CallPlan, PlanSpan, tile_spans
from kvsplice.kvmath.anchors import AgentOffsets, Anchor, kv_offset
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

VOCAB = 101
NUM_LAYERS = 4
ATOL = 1e-4  # fp32 reuse vs dense; measured max |Δlogit| <= 2e-7 for exact oracles


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on a shared 2-core box: intra-op threads only contend (measured 3 s -> 0.03 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_llama(seed: int = 0, initializer_range: float = 0.02) -> LlamaForCausalLM:
    """4 layers, hidden 64, 4 query / 2 KV heads (GQA), fp32, eval.

    initializer_range 0.1 gives peaked next-token distributions (KL tests); the
    default 0.02 gives near-uniform ones.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=initializer_range, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).float().eval()


SYNTH_LAYERS, SYNTH_HEADS, SYNTH_DIM = 3, 2, 4
SYNTH_ROPE = RopeSpec.uniform(SYNTH_DIM, 10000.0, num_layers=SYNTH_LAYERS)


def make_filled_segment(per_token: Sequence[float], start: int = 0) -> SegmentKV:
    """Synthetic K/V [3, 2, T, 4] whose every element of token t is per_token[t] (keys = values)."""
    fill = torch.tensor(list(per_token)).view(1, 1, -1, 1)
    fill = fill.expand(SYNTH_LAYERS, SYNTH_HEADS, -1, SYNTH_DIM).contiguous()
    return SegmentKV(fill.clone(), fill.clone(), start_position=start)


def make_rope(model: LlamaForCausalLM) -> RopeSpec:
    return RopeSpec.from_hf_config(model.config)


def make_ids(num_tokens: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (num_tokens,), generator=generator).tolist())


# One prompt the approximate-mode oracles share: a left context, a chunk reused from another
# context, a tail; the chunk spans [START, END).
LEFT, CHUNK, TAIL = make_ids(8, 21), make_ids(12, 23), make_ids(4, 24)
IDS = (*LEFT, *CHUNK, *TAIL)
START, END = len(LEFT), len(LEFT) + len(CHUNK)


def dense_logits(model: LlamaForCausalLM, ids: Sequence[int]) -> torch.Tensor:
    """The model's own forward over `ids`: last-token logits [V] float32."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([list(ids)])).logits[0, -1].float()


def capture(
    model: LlamaForCausalLM,
    ids: Sequence[int],
    start: int,
    end: int,
    boundary_layers: Sequence[int] = (),
    position_offset: int = 0,
) -> SegmentKV:
    """Tokens [start, end) of one forward pass over `ids` as a segment."""
    return capture_segments(
        model, ids, [(start, end)], boundary_layers=boundary_layers,
        position_offset=position_offset,
    ).segments[0]  # fmt: skip


def full_reuse_span(segment: SegmentKV, start: int, rope: RopeSpec) -> PlanSpan:
    """Naive reuse, built by hand: every layer reads the segment's K/V shifted to `start`."""
    keys = rope.shift_layers(segment.keys, start - segment.start_position)
    kv = SegmentKV(keys, segment.values, start)
    return PlanSpan(start, start + segment.num_tokens, segment.num_layers, kv)


def plan_with(ids: Sequence[int], *reused: PlanSpan) -> CallPlan:
    """`reused` spans in order, every other token computed."""
    return CallPlan(tuple(ids), tile_spans(len(ids), reused))


@dataclass(frozen=True)
class AgentScene:
    """One agent's prompt: head text, a placeholder (the question), next text, tail.

    A placeholder's base K/V is its prefill alone at position 0; the next text's
    base K/V is its prefill in the template without the placeholder.
    """

    model: LlamaForCausalLM
    rope: RopeSpec
    head: tuple[int, ...]
    next_text: tuple[int, ...]
    tail: tuple[int, ...]
    agent_id: str = "agent-1"

    def prompt(self, question: Sequence[int]) -> tuple[int, ...]:
        return (*self.head, *question, *self.next_text, *self.tail)

    def base(self, question: Sequence[int]) -> SegmentKV:
        return capture(self.model, question, 0, len(question))

    def next_base(self) -> SegmentKV:
        ids = (*self.head, *self.next_text)
        return capture(self.model, ids, len(self.head), len(ids))

    def real(self, question: Sequence[int]) -> tuple[SegmentKV, SegmentKV]:
        """The question's and the next text's K/V inside this agent's prompt (dense)."""
        ids, start = self.prompt(question), len(self.head)
        middle = start + len(question)
        return (
            capture(self.model, ids, start, middle),
            capture(self.model, ids, middle, middle + len(self.next_text)),
        )

    def anchor(self, anchor_id: str, question: Sequence[int]) -> Anchor:
        """An anchor made by a dense prefill of this agent's prompt around `question`."""
        base = self.base(question)
        real_question, real_next = self.real(question)
        offsets = AgentOffsets(
            kv_offset(real_question, base, self.rope),
            kv_offset(real_next, self.next_base(), self.rope),
        )
        return Anchor(anchor_id, base, {self.agent_id: offsets})


def make_scene(model: LlamaForCausalLM) -> AgentScene:
    return AgentScene(model, make_rope(model), make_ids(6, 11), make_ids(5, 12), make_ids(3, 13))


def foreign_chunk(model: LlamaForCausalLM) -> SegmentKV:
    """`CHUNK`'s K/V captured after another left context (what a chunk cache holds)."""
    other = make_ids(5, 22)
    return capture(model, (*other, *CHUNK), len(other), len(other) + len(CHUNK))
