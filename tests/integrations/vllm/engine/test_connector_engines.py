"""The connector in real vLLM engines: a fresh engine reuses what another stored, token-exact.

Oracle: an engine without any connector (`reference`) answers every prompt; engine B
(a fresh process, never saw the prompts) must give the same greedy token ids while
loading every full block engine A stored. Faults (a corrupt record, another
tenant, the sidecar gone) cost a recompute, never a wrong token or a failed request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import NAMESPACE
from helpers.waiting import wait_for
from transformers import AutoTokenizer

from kvsplice.client.store.store_client import StoreClient
from kvsplice.client.store.store_config import StoreClientConfig
from kvsplice.common.keys import chunk_links
from kvsplice.eval.bench.vllm_engine import Engine, Sidecar
from kvsplice.eval.workloads.token_transcript import PIPELINE_ROLES, TokenTranscript
from kvsplice.integrations.vllm.engine_fingerprint import engine_fingerprint

# Engines start once for the module; on a loaded 2-core box that alone took 6 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BLOCK = 128  # vLLM's CPU block size
MAX_TOKENS = 24
TASK = (
    "Write a Python function `merge_intervals(intervals)` that takes a list of [start, end] "
    "pairs, merges every pair of overlapping or touching intervals, and returns the merged "
    "intervals sorted by their start. An empty list gives an empty list."
)
OTHER_TASK = (
    "Write a Python function `roman(n)` that converts an integer between 1 and 3999 into a Roman "
    "numeral string, using subtractive notation (IV, IX, XL, XC, CD, CM)."
)


@dataclass(frozen=True)
class Pipeline:
    prompts: list[list[int]]
    answers_a: list[tuple[int, ...]]


def full_blocks(prompt: list[int]) -> int:
    """Tokens an engine may load: whole blocks, at least one prompt token left to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def run_pipeline(engine: Engine, transcript: TokenTranscript, task: str) -> Pipeline:
    prompts, answers = [], []
    for i, (_, instruction) in enumerate(PIPELINE_ROLES):
        if i == 0:
            prompt = transcript.first_prompt(task, instruction)
        else:
            prompt = transcript.next_prompt(prompts[-1], answers[-1], instruction)
        prompts.append(prompt)
        answers.append(
            engine.complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS).token_ids
        )
    return Pipeline(prompts, answers)


def wait_until_stored(sidecar: Sidecar, namespace: str, settle_s: float = 1.5) -> int:
    """The namespace's segment count once it has stopped growing (puts run in the background)."""
    last, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        count = sidecar.namespace_stats(namespace).get("num_segments", 0)
        if count != last:
            last, stable_since = count, time.monotonic()
        elif time.monotonic() - stable_since >= settle_s:
            return count
        time.sleep(0.2)
    return last


@pytest.fixture(scope="module")
def transcript(model_dir: str) -> TokenTranscript:
    return TokenTranscript(AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def pipeline(engines: dict[str, Engine], sidecar: Sidecar, transcript: TokenTranscript) -> Pipeline:
    """Engine A serves the five agents' prompts; their chunks are stored by the time it returns."""
    pipeline = run_pipeline(engines["a"], transcript, TASK)
    assert len(pipeline.prompts[-1]) > 3 * BLOCK
    wait_until_stored(sidecar, NAMESPACE)
    return pipeline


def test_a_fresh_engine_loads_every_full_block_and_answers_token_exactly(
    engines: dict[str, Engine], pipeline: Pipeline, sidecar: Sidecar
) -> None:
    before = sidecar.namespace_stats(NAMESPACE)["num_hit_tokens"]
    loaded = 0
    for prompt in pipeline.prompts:
        expected = engines["reference"].complete(
            prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS
        )
        got = engines["b"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        assert got.num_cached_tokens == full_blocks(prompt)
        assert expected.num_cached_tokens == 0
        assert got.token_ids == expected.token_ids
        loaded += got.num_cached_tokens
    assert loaded >= 6 * BLOCK
    # what an operator sees: the engines report every loaded token (a background flush, ~1 s;
    # the deadline only bounds a hang)
    stats = wait_for(
        lambda: sidecar.namespace_stats(NAMESPACE),
        lambda s: s["num_hit_tokens"] - before >= loaded,
        timeout_s=120.0,
        interval_s=0.5,
    )
    assert stats["num_hit_tokens"] - before >= loaded
    assert stats["hit_tokens_by_source"].get("in_place", 0) >= loaded  # read in place, same host


def test_another_tenant_loads_nothing(engines: dict[str, Engine], pipeline: Pipeline) -> None:
    prompt = pipeline.prompts[-1]
    expected = engines["reference"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    got = engines["b"].complete(
        prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, cache_salt="tenant-b"
    )
    assert got.num_cached_tokens == 0
    assert got.token_ids == expected.token_ids


def test_a_corrupt_record_costs_a_recompute_never_a_wrong_token(
    engines: dict[str, Engine],
    sidecar: Sidecar,
    transcript: TokenTranscript,
    model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    prompt = transcript.first_prompt(OTHER_TASK, PIPELINE_ROLES[0][1]) * 3  # > 3 blocks
    engines["a"].complete(prompt, max_tokens=8)
    wait_until_stored(sidecar, NAMESPACE)
    links = chunk_links(engine_fingerprint(Path(model_dir), "bfloat16"), prompt, BLOCK)
    corrupt_in_lmdb(sidecar, links[1].key)
    expected = engines["reference"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    got = engines["b"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    assert got.token_ids == expected.token_ids
    assert (
        "failed verification" in engines["b"].log_path.read_text()
        or "recomputing" in engines["b"].log_path.read_text()
    )


def test_with_the_sidecar_down_engines_answer_alone(
    engines: dict[str, Engine], pipeline: Pipeline, sidecar: Sidecar
) -> None:
    sidecar.stop()
    try:
        prompt = pipeline.prompts[2]
        expected = engines["reference"].complete(
            prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS
        )
        got = engines["b"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        assert got.num_cached_tokens == 0
        assert got.token_ids == expected.token_ids
    finally:
        sidecar.start()


def corrupt_in_lmdb(sidecar: Sidecar, context_key: bytes) -> None:
    """Flip bytes of one stored payload inside the sidecar's LMDB file (what same-host reads map)."""
    config = StoreClientConfig(same_host_reads=False)
    with StoreClient(sidecar.target, NAMESPACE, config=config) as client:
        found = client.get_segment(context_key)
    assert found is not None, "the chunk to corrupt is not stored"
    payload = bytes(found[1])
    window = payload[len(payload) // 2 : len(payload) // 2 + 64]
    data_file = sidecar.data_dir / "data.mdb"
    raw = data_file.read_bytes()
    offset = raw.index(window)
    with data_file.open("r+b") as f:
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in window))
