"""Cross-candidate attention diagnostics of judge calls, dense vs each reuse mode.

Owns `AttentionProbe` (a `bench.judge.runner.PrefillProbe`) and `AttentionProfile`. Per
layer it measures (1) the attention mass from the decision position (the prompt's
last token) to the prefix, each display slot's candidate block and the rest, over
the K/V the mode actually built (the last token re-run on that cache with eager
attention: it is computed through every layer in every mode, so the re-run is that
call's own computation); (2) for each block, its tokens' mass to the earlier blocks
under dense prefill, kept only where the mode computed that token·layer in the
judge's context (a reused token·layer never attended to this prompt's earlier blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvsplice.agents.render import RenderedPrompt
from kvsplice.client.execute.execution import ExecutionState, ReuseMap
from kvsplice.client.model.hf_cache import (
    append_layer_runs,
    cache_kwarg,
    full_length_cache,
    read_layers,
)
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.base import CandidateBlock, candidate_blocks
from kvsplice.eval.workloads.judge_examples import JudgeExample

logger = logging.getLogger(__name__)

REFERENCE = "reference"


@dataclass(frozen=True)
class AttentionProfile:
    """One mode's mean attention over its judge calls (lists so it serializes as is).

    decision[l][r]: mass from the decision position at layer l to region r, regions
    being "prefix", "slot 1".."slot n", "other" (headers, instruction, decision line);
    cross_block[l][k]: mean mass of slot k's tokens to slots < k at layer l (slot 1: 0).
    """

    mode: str
    num_calls: int
    regions: tuple[str, ...]
    decision: list[list[float]]
    cross_block: list[list[float]]

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "num_calls": self.num_calls, "regions": list(self.regions),
                "decision": self.decision, "cross_block": self.cross_block}  # fmt: skip


class AttentionProbe:
    """Collects attention per judge call; `profiles()` averages them per mode.

    Examples with other candidate counts than the first seen are skipped (the regions
    must line up to be averaged).
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self._decision: dict[str, list[torch.Tensor]] = {}
        self._cross: dict[str, list[torch.Tensor]] = {}
        self._dense_cross: torch.Tensor | None = None  # of the example being judged
        self._num_slots: int | None = None

    def __call__(
        self, mode: str, example: JudgeExample, prompt: RenderedPrompt, state: ExecutionState
    ) -> None:
        blocks = candidate_blocks(prompt)
        self._num_slots = self._num_slots or len(blocks)
        if len(blocks) != self._num_slots:
            return
        keys, values = read_layers(state.cache, 0, prompt.num_tokens - 1)
        decision = decision_attention(self._loaded, prompt, keys, values)
        self._decision.setdefault(mode, []).append(decision)
        if mode == REFERENCE:  # runs first for every example
            self._dense_cross = cross_block_attention(self._loaded, prompt)
        assert self._dense_cross is not None
        kept = self._dense_cross * computed_share(state.reuse, blocks, keys.shape[0])
        self._cross.setdefault(mode, []).append(kept)

    def profiles(self) -> list[AttentionProfile]:
        n = self._num_slots or 0
        regions = ("prefix", *(f"slot {k + 1}" for k in range(n)), "other")
        return [
            AttentionProfile(mode, len(calls), regions,
                             torch.stack(calls).mean(0).tolist(),
                             torch.stack(self._cross[mode]).mean(0).tolist())
            for mode, calls in self._decision.items()
        ]  # fmt: skip


def decision_attention(
    loaded: LoadedModel, prompt: RenderedPrompt, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """[L, n + 2] mass from the last prompt token to each region, heads averaged.

    keys, values: [L, H_kv, T - 1, D], the call's cache for every token before the last.
    """
    model = loaded.model
    cache = full_length_cache()
    append_layer_runs(cache, [keys.to(model.dtype)], [values.to(model.dtype)])
    last = prompt.num_tokens - 1
    with _eager_attention(model) as weights:
        ids = torch.tensor([[prompt.token_ids[last]]], device=model.device)
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.tensor([[last]], device=model.device),
                  **cache_kwarg(model, cache), use_cache=True, logits_to_keep=1)  # fmt: skip
    # weights[l]: [H, 1, T] -> [T]
    rows = torch.stack([w[:, -1].mean(0) for w in weights])
    return _regions(rows, prompt)


def cross_block_attention(loaded: LoadedModel, prompt: RenderedPrompt) -> torch.Tensor:
    """[L, n]: under dense prefill, the mean mass of each block's tokens to earlier blocks."""
    model = loaded.model
    blocks = candidate_blocks(prompt)
    earlier = torch.zeros(len(blocks), prompt.num_tokens, dtype=torch.bool)
    for k in range(len(blocks)):
        for before in blocks[:k]:
            earlier[k, before.start : before.end] = True

    def reduce(w: torch.Tensor) -> torch.Tensor:  # w: [H, T, T]
        mean = w.float().mean(0)
        return torch.stack(
            [(mean[b.start : b.end] * earlier[k]).sum(-1).mean() for k, b in enumerate(blocks)]
        )

    with _eager_attention(model, reduce) as reduced:
        ids = torch.tensor([list(prompt.token_ids)], device=model.device)
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return torch.stack(reduced)


def computed_share(
    reuse: ReuseMap, blocks: Sequence[CandidateBlock], num_layers: int
) -> torch.Tensor:
    """[L, n]: the share of each block's tokens whose layer-l K/V the call computed."""
    reused = torch.zeros(num_layers, len(blocks))
    for span in reuse.reused:
        layers = slice(*span.layers)
        for k, block in enumerate(blocks):
            overlap = min(span.end, block.end) - max(span.start, block.start)
            if overlap > 0:
                reused[layers, k] += overlap / block.num_tokens
    return 1.0 - reused.clamp(max=1.0)


def _regions(rows: torch.Tensor, prompt: RenderedPrompt) -> torch.Tensor:
    """rows: [L, T] -> [L, n + 2] (prefix, each block, everything else)."""
    blocks = candidate_blocks(prompt)
    masses = [rows[:, : blocks[0].start].sum(-1)]
    masses += [rows[:, b.start : b.end].sum(-1) for b in blocks]
    masses.append(rows.sum(-1) - sum(masses))
    return torch.stack(masses, dim=-1).float().cpu()


@contextmanager
def _eager_attention(
    model: PreTrainedModel, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Iterator[list[torch.Tensor]]:
    """Eager attention for the block, each layer's weights [H, q, T] (or `reduce` of them)
    appended to the yielded list as the layers run; the implementation is restored after."""
    previous = model.config._attn_implementation
    collected: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, _inputs: object, output: tuple[torch.Tensor, ...]) -> None:
        weights = output[1][0].detach()
        collected.append(weights.float().cpu() if reduce is None else reduce(weights).cpu())

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    model.set_attn_implementation("eager")
    try:
        yield collected
    finally:
        model.set_attn_implementation(previous)
        for handle in handles:
            handle.remove()
