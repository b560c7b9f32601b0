"""The reuse engine: one agent call = plan (policy) → prefill (executor) → decode → store.

Owns the call's clock: TTFT runs from when the caller has the inputs to the
first generated token and includes every cost of the reuse path (lookups,
fetch, decode, shift, base prefill, splice, prefill, first token); storing
happens after it. It knows no agents or templates, only spanned prompts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from cachetools import LRUCache

from kvsplice.client.execute.call_executor import CallExecutor
from kvsplice.client.execute.execution import (
    CallTimings,
    ExecutionState,
    GenerationConfig,
    ReusedRange,
    ReuseMap,
    content_tokens,
)
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.chat_prompt import ChatMessage, chat_prompt
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.admission import AdmissionPolicy, default_policy
from kvsplice.client.modes.base import CallContext, ReusePolicy, SpannedPrompt, StoreContext
from kvsplice.client.modes.registry import CHAIN_ONLY_MODES
from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.client.tiers.segment_io import DirectPuts, SegmentWriter
from kvsplice.common.reuse_report import ReusedRun
from kvsplice.kvmath import cpu_decode
from kvsplice.kvmath.quant import check_quant
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

# Answers `chat` remembers (text → generated ids) so a later message quoting one is exact.
MAX_REMEMBERED_ANSWERS = 1024


@dataclass(frozen=True)
class EngineConfig:
    """`quant`: payload scheme of stored segments ("none", "fp16", "int8").

    `store_segments`: put each call's segments after its first token.
    `local_tier_bytes`: the worker's decoded tier (0: none), on the model's device.
    `async_store`: put segments on a writer thread while the next call runs
    (`max_queued_calls` calls may wait; more blocks the caller); else before
    `run` returns. Only modes in `CHAIN_ONLY_MODES` store in the background (see
    the NOTE there); the others always put before `run` returns.
    """

    # NOTE: "none" by default because `exact` promises zero drift: only payloads
    # stored as captured splice to logits equal to dense. int8 (4x smaller) is an
    # opt-in that turns every reuse into an approximation with a measured drift.
    quant: str = "none"
    store_segments: bool = True
    local_tier_bytes: int = 512 << 20
    async_store: bool = True
    max_queued_calls: int = 16

    def __post_init__(self) -> None:
        check_quant(self.quant)
        if self.local_tier_bytes < 0:
            raise ValueError(f"local_tier_bytes {self.local_tier_bytes} must be >= 0")
        if self.max_queued_calls < 1:
            raise ValueError(f"max_queued_calls {self.max_queued_calls} must be >= 1")


@dataclass(frozen=True)
class ReusedSpan:
    """A reused range of the prompt: the prompt spans it covers, the rule, size and shift.

    num_layers: how many layers' K/V it reused (the model's all for span-level
    modes; fewer for multicut's lower layers, blend's unselected tokens).
    start: its first prompt position.
    """

    name: str
    mode: str
    num_tokens: int
    delta: int
    exact: bool
    num_layers: int = 0
    start: int = 0


@dataclass
class CallOutcome:
    """Everything one call produced and measured.

    output_ids: generated ids without a trailing stop token (what downstream
    agents see); generated_ids: as generated. logits_first: [V] float32 logits of
    the last prompt token (the first token's distribution). decisions: the
    policy's gate outcomes (`PlannedCall.decisions`). text: the decoded answer (`chat` calls).
    """

    mode: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    logits_first: torch.Tensor
    ttft_s: float
    num_reused_tokens: int
    reused: tuple[ReusedSpan, ...]
    timings: CallTimings = field(default_factory=CallTimings)
    decisions: Mapping[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class ReuseEngine:
    """Runs calls on one model with one policy against one store (or none).

    With `admission`, the policy must be admitted for this model (else
    `FingerprintMismatch` / `ModeNotAdmitted` here, at construction) and a mode
    given by name takes its parameters; without, any mode runs (benchmarks).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        policy: ReusePolicy | str,
        store: StoreClient | None = None,
        config: EngineConfig | None = None,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.loaded = loaded
        mode = policy if isinstance(policy, str) else policy.mode
        if admission is not None:
            admission.check(loaded.fingerprint, mode)
        if isinstance(policy, str):
            # a routing mode (`gated`) without a policy routes over the safe default
            policy = (admission or default_policy(loaded.fingerprint)).policy_of(policy)
        self.policy = policy
        self.store = store
        self.config = config or EngineConfig()
        self.executor = CallExecutor(loaded.model, loaded.layout, loaded.rope)
        if next(loaded.model.parameters()).device.type == "cpu":
            cpu_decode.warm_up()  # compiled once per process here, never inside a call's TTFT
        self.local = self._local_tier()
        self.writer = self._writer()
        self._answers: LRUCache[str, tuple[int, ...]] = LRUCache(maxsize=MAX_REMEMBERED_ANSWERS)

    def flush(self) -> None:
        """Return once every segment queued so far is stored (or counted as failed)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Store what is queued and stop the writer thread (the store client stays open)."""
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> ReuseEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def mode(self) -> str:
        return self.policy.mode

    def run(
        self,
        prompt: SpannedPrompt,
        generation: GenerationConfig,
        *,
        started_at_s: float | None = None,
        on_prefill: Callable[[ExecutionState], None] | None = None,
    ) -> CallOutcome:
        """One call. `started_at_s`: `time.perf_counter()` when the inputs were ready.

        `on_prefill` sees the prefilled state (its cache as the plan built it) after
        the first token and before decoding, outside the TTFT (diagnostics).
        """
        start_s = time.perf_counter() if started_at_s is None else started_at_s
        generation = generation.with_eos(self.loaded.eos_token_ids)
        ctx = self._context(CallTimings())
        self.local.take_hit_keys()  # what earlier users of the tier found is not this call's
        with self._prefilling():
            planned = self.policy.plan(prompt, ctx)
            state = self.executor.prefill(planned.plan, ctx.timings, planned.result)
        ttft_s = time.perf_counter() - start_s  # prefill picked the token with a host sync
        local_keys = self.local.take_hit_keys()
        if on_prefill is not None:
            on_prefill(state)
        self.executor.generate(state, generation, ctx.timings)
        output = content_tokens(state.generated, generation)
        if self.config.store_segments:
            store_start_s = time.perf_counter()
            self.policy.after_call(prompt, planned, state, ctx, output)
            ctx.timings.add("store_s", time.perf_counter() - store_start_s)
        self._report_reuse(state.reuse, local_keys)
        return _outcome(self.mode, prompt, state, output, ttft_s, ctx.timings, planned.decisions)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        generation: GenerationConfig,
        *,
        started_at_s: float | None = None,
    ) -> CallOutcome:
        """One call on OpenAI-style messages (`{"role", "content"}`), each message its own spans.

        The model's chat template is applied per message (`chat_prompt`), so every
        message shared with an earlier call after the same messages is an exact hit.
        An assistant message whose content is an answer this engine generated
        (`outcome.text`, unchanged) is laid out as its generated ids, so the K/V
        stored for that answer is reused too. `outcome.text` is the answer's text.
        """
        start_s = time.perf_counter() if started_at_s is None else started_at_s
        tokenizer = self.loaded.tokenizer
        prompt = chat_prompt(messages, tokenizer, known_outputs=self._answers)
        outcome = self.run(prompt, generation, started_at_s=start_s)
        outcome.text = self.loaded.decode(outcome.output_ids, skip_special_tokens=True)
        self._answers[outcome.text] = outcome.output_ids
        return outcome

    def dense_reference(self, prompt: SpannedPrompt, generation: GenerationConfig) -> CallOutcome:
        """The same prompt prefilled densely, nothing looked up or stored (fidelity reference)."""
        generation = generation.with_eos(self.loaded.eos_token_ids)
        timings = CallTimings()
        start_s = time.perf_counter()
        state = self.executor.prefill(CallPlan.all_compute(prompt.token_ids), timings)
        ttft_s = time.perf_counter() - start_s
        self.executor.generate(state, generation, timings)
        output = content_tokens(state.generated, generation)
        return _outcome("dense", prompt, state, output, ttft_s, timings)

    def _report_reuse(self, reuse: ReuseMap, local_keys: frozenset[bytes]) -> None:
        """Tell the store what this call reused, where each run was served and whether it
        was exact (queued).

        A run whose segment this call found in the local tier was served "local";
        any other, where the store client read it (`served_from`).
        """
        if self.store is None:
            return
        runs = []
        for reused in reuse.reused:
            source = reused.source
            key = source.chain_key if source is not None else None
            served = "local" if key in local_keys else self.store.served_from(key)
            exact = source is None or source.exact
            runs.append(ReusedRun(reused.num_tokens, served, key, exact))
        self.store.report_reuse(reuse.num_tokens, runs)

    def _prefilling(self) -> AbstractContextManager[None]:
        """Background puts hold off until the first token (they would slow the prefill)."""
        return nullcontext() if self.writer is None else self.writer.paused()

    def _local_tier(self) -> LocalTier:
        if self.store is None or self.config.local_tier_bytes == 0:
            # NOTE: 0 bytes keep nothing; on the CPU, where payloads decode, it moves nothing.
            return LocalTier(0)
        return LocalTier(self.config.local_tier_bytes, self.loaded.model.device)

    def _writer(self) -> SegmentWriter | None:
        background = self.config.store_segments and self.config.async_store
        if self.store is None or not background or self.mode not in CHAIN_ONLY_MODES:
            return None
        return SegmentWriter(
            self.store,
            fingerprint=self.loaded.fingerprint,
            quant=self.config.quant,
            local=self.local,
            max_queued_batches=self.config.max_queued_calls,
        )

    def _context(self, timings: CallTimings) -> CallContext:
        """The call's context: a `StoreContext` when the engine has a store."""
        tokenizer = self.loaded.tokenizer
        ctx = CallContext(
            fingerprint=self.loaded.fingerprint,
            executor=self.executor,
            # Decoded in fp32 so a half-precision model's keys are shifted, then cast, once.
            decode_dtype=torch.float32,
            timings=timings,
            decode_text=lambda ids: self.loaded.decode(ids, skip_special_tokens=False),
            encode_text=lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)),
            quant=self.config.quant,
            rope=self.loaded.rope,
        )
        if self.store is None:
            return ctx
        if self.writer is not None:
            return StoreContext.of(ctx, self.store, self.local, self.writer)
        puts = DirectPuts(
            self.store, fingerprint=ctx.fingerprint, quant=ctx.quant, local=self.local
        )
        return StoreContext.of(ctx, self.store, self.local, puts)


def _outcome(
    mode: str,
    prompt: SpannedPrompt,
    state: ExecutionState,
    output: tuple[int, ...],
    ttft_s: float,
    timings: CallTimings,
    decisions: Mapping[str, str] | None = None,
) -> CallOutcome:
    reuse = state.reuse
    return CallOutcome(
        mode=mode,
        prompt_ids=reuse.token_ids,
        output_ids=output,
        generated_ids=tuple(state.generated),
        logits_first=state.logits_first,
        ttft_s=ttft_s,
        num_reused_tokens=reuse.num_reused_tokens,
        reused=tuple(_reused_span(prompt, r) for r in reuse.reused),
        timings=timings,
        decisions=dict(decisions or {}),
    )


def _reused_span(prompt: SpannedPrompt, reused: ReusedRange) -> ReusedSpan:
    source = reused.source
    assert source is not None
    names = [s.name for s in prompt.spans if s.start < reused.end and reused.start < s.end]
    return ReusedSpan(
        "+".join(names), source.mode, reused.num_tokens, source.delta, source.exact,
        reused.num_layers, reused.start,
    )  # fmt: skip
