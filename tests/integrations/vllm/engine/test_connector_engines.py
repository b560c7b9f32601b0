"""The connector in real vLLM engines run as vLLM runs by default: token-exact reuse.

Oracle: an engine without any connector or prefix cache (`reference`, float32)
answers every prompt; engine B (a fresh process, never saw the prompts) must give the
same greedy token ids while loading every full block engine A stored. The engines
with the connector keep vLLM's defaults (prefix caching on, async scheduling,
chunked prefill: at most 512 tokens a step) and a KV cache small enough that
concurrent requests preempt. Faults (a corrupt record, another tenant, the sidecar
gone) cost a recompute, never a wrong token or a failed request.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import KV_BLOCKS, NAMESPACE
from fault_soak import (
    Schedule,
    Soak,
    corrupt_stored,
    inject_faults,
    soak_prompts,
    verify_stored,
)
from helpers.waiting import wait_for

# The KV event streams, checked on these engines (the test lives in its own module).
from kv_event_checks import test_kv_events_name_what_the_sidecar_holds_in_vllms_words  # noqa: F401
from session_checks import test_a_chat_request_s_session_id_reaches_the_sidecar  # noqa: F401
from transformers import AutoTokenizer

from kvsplice.common.keys import chunk_links
from kvsplice.eval.bench.vllm.engine import Engine, Sidecar
from kvsplice.eval.workloads.token_transcript import PIPELINE_ROLES, TokenTranscript

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
    counters_before = engines["b"].counters()
    cached = 0
    for prompt in pipeline.prompts:
        expected = engines["reference"].complete(
            prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS
        )
        got = engines["b"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        assert got.num_cached_tokens == full_blocks(prompt)  # its own prefix cache + the sidecar
        assert expected.num_cached_tokens == 0
        assert got.token_ids == expected.token_ids
        cached += got.num_cached_tokens
    counters = engines["b"].counters()
    external = _delta(counters, counters_before, "vllm:external_prefix_cache_hits_total")
    local = _delta(counters, counters_before, "vllm:prefix_cache_hits_total")
    # agent 1's blocks come from the sidecar; agent k's prefix is agent k-1's prompt and
    # answer, which this engine computed itself: its own prefix cache serves those.
    # NOTE: vLLM counts a local hit each time it asks the connector, and a request whose
    # lookup is still under way is asked again next step: `local` may count a hit twice.
    assert external >= 2 * BLOCK and local > 0 and external <= cached
    # what an operator sees: the sidecar counts exactly the tokens the engine loaded (its
    # reports flush in the background, ~1 s; the deadline only bounds a hang), and vLLM's
    # own /metrics counts its local prefix-cache hits beside them
    stats = wait_for(
        lambda: sidecar.namespace_stats(NAMESPACE),
        lambda s: s["num_hit_tokens"] - before >= external,
        timeout_s=120.0,
        interval_s=0.5,
    )
    assert stats["num_hit_tokens"] - before == external
    assert stats["hit_tokens_by_source"].get("in_place", 0) >= external  # same host: in place
    # kvsplice's own counters in vLLM's /metrics (get_kv_connector_stats) agree with both
    ours = wait_for(
        engines["b"].counters,
        lambda c: _delta(c, counters_before, "vllm:kvsplice_loaded_tokens_total") >= external,
        timeout_s=30.0,
        interval_s=0.5,
    )
    assert _delta(ours, counters_before, "vllm:kvsplice_loaded_tokens_total") == external
    assert _delta(ours, counters_before, "vllm:kvsplice_promised_exact_tokens_total") == external
    assert _delta(ours, counters_before, "vllm:kvsplice_lookups_total") >= 1
    assert _delta(ours, counters_before, "vllm:kvsplice_failed_loads_total") == 0


def _delta(now: dict[str, float], before: dict[str, float], name: str) -> float:
    return now.get(name, 0.0) - before.get(name, 0.0)


def engine_fingerprint_of(engine: Engine) -> str:
    """The fingerprint the engine's connector keys its chains with (it logs it at start)."""
    found = re.findall(r"fingerprint (kvfp1-[0-9a-f]{32})", engine.log_path.read_text())
    assert found, f"no kvsplice fingerprint in {engine.log_path}"
    return found[-1]


def test_another_tenant_loads_nothing(engines: dict[str, Engine], pipeline: Pipeline) -> None:
    prompt = pipeline.prompts[-1]
    expected = engines["reference"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    got = engines["b"].complete(
        prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, cache_salt="tenant-b"
    )
    assert got.num_cached_tokens == 0
    assert got.token_ids == expected.token_ids


PERSONA_A = "You are Ada, a meticulous reviewer who checks every edge case before answering."
PERSONA_B = (
    "You are Bo, a pragmatic engineer. You answer in short, direct sentences, name the function "
    "you would write first, and never repeat the question back to the user."
)
SHARED = "\n".join(  # a tool's output every agent of a task reads (about 900 tokens)
    f"def step_{i}(values):\n    return [v * {i} + {i * i % 17} for v in values if v > {i}]"
    for i in range(40)
)


def persona_prompt(transcript: TokenTranscript, persona: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": persona}, {"role": "user", "content": user}]
    tokenizer = transcript.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_a_gated_request_gets_the_shared_context_moved_and_nobody_else_does(
    engines: dict[str, Engine], sidecar: Sidecar, transcript: TokenTranscript
) -> None:
    """Persona-first: agent A (engine a) read the tool output under its persona; agent B
    (engine b, another persona, so no exact prefix past its own first tokens) opts in
    and gets the output's K/V as A computed it, moved to its positions. A request of the
    same tokens without the opt-in then gets nothing approximate: not from the sidecar,
    not from engine b's prefix cache (which holds the gated request's blocks), and
    answers exactly as the reference."""
    user = f"{SHARED}\n\n{TASK}"
    engines["a"].complete(persona_prompt(transcript, PERSONA_A, user), max_tokens=1)
    earlier = persona_prompt(transcript, PERSONA_B, f"{OTHER_TASK}\n\n{TASK}\n\n{OTHER_TASK}")
    engines["b"].complete(earlier, max_tokens=1)  # B's persona, stored by an earlier task
    wait_until_stored(sidecar, NAMESPACE)
    prompt = persona_prompt(transcript, PERSONA_B, user)
    counted = reported_settled(sidecar)
    gated = engines["b"].complete_with_params(
        prompt, max_tokens=MAX_TOKENS, kv_transfer_params={"kvsplice": {"reuse": "gated"}}
    )
    report = (gated.kv_transfer_params or {}).get("kvsplice")
    assert report is not None and report["reuse"] == "gated" and report["admitted"] is True
    assert report["exact_tokens"] + report["approximate_tokens"] == full_blocks(prompt)
    assert report["approximate_tokens"] >= 0.6 * len(prompt), report
    assert len(gated.token_ids) == MAX_TOKENS
    wait_until_stored(sidecar, NAMESPACE)  # what it saved past its fence, off-chain
    # what an operator sees: the sidecar counts the approximate tokens apart from the exact
    gated_counted = reported_settled(sidecar, calls=counted["num_calls"] + 1)
    grown = {k: gated_counted[k] - counted[k] for k in counted}
    assert grown["num_approximate_hit_tokens"] == report["approximate_tokens"], grown
    assert grown["num_exact_hit_tokens"] == report["exact_tokens"], grown
    assert any(not s["exact"] for s in sidecar.segments(NAMESPACE))  # `ls`: off-chain

    before = engines["b"].counters()
    plain = engines["b"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    after = engines["b"].counters()
    expected = engines["reference"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    local = _delta(after, before, "vllm:prefix_cache_hits_total")
    external = _delta(after, before, "vllm:external_prefix_cache_hits_total")
    assert local + external <= report["exact_tokens"]  # never the approximate blocks
    assert plain.token_ids == expected.token_ids
    plain_counted = reported_settled(sidecar, calls=gated_counted["num_calls"] + 1)
    assert (
        plain_counted["num_approximate_hit_tokens"] == gated_counted["num_approximate_hit_tokens"]
    )  # the request that did not opt in: nothing approximate
    assert plain_counted["num_exact_hit_tokens"] - gated_counted["num_exact_hit_tokens"] == external
    sidecar.restart()  # the same counts after a restart on the same LMDB
    assert reported_settled(sidecar) == plain_counted


REPORTED = (
    "num_calls",
    "num_requested_tokens",
    "num_exact_hit_tokens",
    "num_approximate_hit_tokens",
)


def reported_settled(sidecar: Sidecar, calls: int = 0) -> dict[str, int]:
    """The namespace's reported counts once they hold `calls` calls and stopped moving
    (engines flush their reports in the background, about once a second)."""
    last: dict[str, int] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        row = sidecar.namespace_stats(NAMESPACE)
        now = {name: row.get(name, 0) for name in REPORTED}
        if now == last and now["num_calls"] >= calls:
            return now
        last = now
        time.sleep(2.0)
    raise AssertionError(f"reported counts never settled at {calls} calls: {last}")


def test_a_corrupt_record_costs_a_recompute_never_a_wrong_token(
    engines: dict[str, Engine],
    sidecar: Sidecar,
    transcript: TokenTranscript,
) -> None:
    """Issue 33's reproduction: a corrupt chunk, a load that fails there in a step that also
    computes later chunks, then a longer prompt loading what was stored after the fault."""
    prompt = transcript.first_prompt(OTHER_TASK, PIPELINE_ROLES[0][1]) * 3  # > 3 blocks
    engines["a"].complete(prompt, max_tokens=8)
    wait_until_stored(sidecar, NAMESPACE)
    links = chunk_links(engine_fingerprint_of(engines["a"]), prompt, BLOCK)
    corrupt_stored(sidecar, NAMESPACE, links[1].key)
    longer = prompt + transcript.first_prompt(TASK, PIPELINE_ROLES[1][1])
    for engine in ("b", "a", "b"):  # the fault, then a (its own cache) and b (the sidecar)
        expected = engines["reference"].complete(
            longer, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS
        )
        got = engines[engine].complete(longer, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        assert got.token_ids == expected.token_ids
        longer = longer + transcript.first_prompt(OTHER_TASK, PIPELINE_ROLES[2][1])
    log = engines["b"].log_path.read_text()
    assert "corrupt" in log and log.count("kvsplice load failed") <= 2  # once, not per chunk
    # the corrupt record was deleted and is not promised again; what is stored now verifies
    verify_stored(sidecar, NAMESPACE, engines, [prompt, longer])


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


# ---- as vLLM runs: many requests at once, preemption, aborts, faults under load ------------


def mixed_prompts(transcript: TokenTranscript, pipeline: Pipeline) -> list[list[int]]:
    """Shared prefixes with different tails, exact repeats, prompts already stored."""
    prompts = []
    for i, task in enumerate((TASK, OTHER_TASK)):
        for j, (_, instruction) in enumerate(PIPELINE_ROLES):
            base = transcript.first_prompt(task, instruction)
            tail = transcript.first_prompt(
                OTHER_TASK if i == 0 else TASK, PIPELINE_ROLES[-1 - j][1]
            )
            prompts += [base + tail[: 40 + 17 * j], base + tail]
    return [*prompts, *pipeline.prompts[:4], prompts[0]]  # 25; repeats in one step


def complete_all(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    with ThreadPoolExecutor(16) as pool:
        done = pool.map(
            lambda p: engine.complete(p, max_tokens=max_tokens, min_tokens=max_tokens), prompts
        )
        return [c.token_ids for c in done]


def test_concurrent_requests_preempted_and_chunked_answer_as_the_reference(
    engines: dict[str, Engine], pipeline: Pipeline, transcript: TokenTranscript, sidecar: Sidecar
) -> None:
    prompts = mixed_prompts(transcript, pipeline)
    expected = [
        engines["reference"].complete(p, max_tokens=16, min_tokens=16).token_ids for p in prompts
    ]
    before = {name: engines[name].counters() for name in ("a", "b")}
    assert complete_all(engines["a"], prompts, 16) == expected  # hits, misses, saves at once
    wait_until_stored(sidecar, NAMESPACE)
    engines["b"].reset_prefix_cache()
    assert complete_all(engines["b"], prompts, 16) == expected  # loads and local hits at once
    after = {name: engines[name].counters() for name in ("a", "b")}
    preempted = sum(_delta(after[n], before[n], "vllm:num_preemptions_total") for n in after)
    loaded = _delta(after["b"], before["b"], "vllm:external_prefix_cache_hits_total")
    assert preempted > 0, "the small KV cache should have forced preemptions"
    assert loaded >= 10 * BLOCK


def test_aborted_requests_leave_the_engines_serving(
    engines: dict[str, Engine], pipeline: Pipeline, transcript: TokenTranscript
) -> None:
    prompts = mixed_prompts(transcript, pipeline)[:12]

    def abort(prompt: list[int]) -> None:
        try:  # the client goes away mid-stream (or before its first token): vLLM aborts it
            with httpx.stream("POST", f"{engines['b'].url}/v1/completions", timeout=0.3, json={
                "model": engines["b"].spec.model_dir, "prompt": [*prompt, 11, 12],
                "max_tokens": 400, "stream": True,
            }) as response:  # fmt: skip
                next(response.iter_lines())
        except httpx.HTTPError:
            pass

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(abort, prompts))
    expected = [
        engines["reference"].complete(p, max_tokens=8, min_tokens=8).token_ids for p in prompts[:4]
    ]
    assert complete_all(engines["b"], prompts[:4], 8) == expected


# The soak's reduced form runs in `make test` (120 requests over 100 prompts: the reference
# engine computes each prompt once, so the prompts set its cost); its full form (the issue's
# 500 requests over 32 tokens): KVSPLICE_SOAK_REQUESTS=500 KVSPLICE_SOAK_TOKENS=32
# KVSPLICE_SOAK_PROMPTS=200. KVSPLICE_SOAK_REPORT=path writes what was injected and counted.
SOAK_REQUESTS = int(os.environ.get("KVSPLICE_SOAK_REQUESTS", "120"))
SOAK_TOKENS = int(os.environ.get("KVSPLICE_SOAK_TOKENS", "8"))
SOAK_PROMPTS = int(os.environ.get("KVSPLICE_SOAK_PROMPTS", "100"))
SOAK_STOP_S = 6.0


def test_fault_soak_two_engines_answer_every_request_as_the_reference(
    engines: dict[str, Engine], transcript: TokenTranscript, sidecar: Sidecar
) -> None:
    """Distinct prompts over shared prefixes through two engines while the sidecar is SIGKILLed
    and restarted, stored bytes are flipped, segments are deleted between lookup and load and
    the sidecar is SIGSTOPped (`fault_soak`): every request answers as the reference over
    SOAK_TOKENS tokens, kvsplice counts every fault, and what is stored afterwards verifies."""
    run_soak(engines, transcript, sidecar, SOAK_REQUESTS, SOAK_TOKENS)


def run_soak(
    engines: dict[str, Engine], transcript: TokenTranscript, sidecar: Sidecar,
    num_requests: int, num_tokens: int,
) -> dict[str, object]:  # fmt: skip
    """The soak's requests and faults, its assertions; returns what was injected and counted."""
    bases = [transcript.first_prompt(t, r) for t in (TASK, OTHER_TASK) for _, r in PIPELINE_ROLES]
    prompts = soak_prompts(transcript.tokenizer, bases, SOAK_PROMPTS)
    assert len({tuple(p) for p in prompts}) == SOAK_PROMPTS
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda p: engines["reference"].complete(
            p, max_tokens=num_tokens, min_tokens=num_tokens).token_ids, prompts))  # fmt: skip
    assert all(len(e) == num_tokens for e in expected)
    soak = Soak(
        engines, sidecar, NAMESPACE, engine_fingerprint_of(engines["a"]), prompts, expected,
        Schedule(SOAK_PROMPTS, num_requests), num_tokens,
    )  # fmt: skip
    referenced = time.monotonic()
    with ThreadPoolExecutor(1) as chaos_pool, ThreadPoolExecutor(8) as pool:
        injected = chaos_pool.submit(inject_faults, soak, SOAK_STOP_S, KV_BLOCKS)
        list(pool.map(soak.one, range(num_requests)))
        counts = injected.result(timeout=900)
    report = {"requests": num_requests, "probes": soak.num_probes, "prompts": SOAK_PROMPTS,
              "tokens": num_tokens, "reference_s": round(referenced - started, 1),
              "soak_s": round(time.monotonic() - referenced, 1), **counts}  # fmt: skip
    if os.environ.get("KVSPLICE_SOAK_REPORT"):  # before the checks: a failed soak's counts too
        Path(os.environ["KVSPLICE_SOAK_REPORT"]).write_text(json.dumps(report, indent=1))
    assert soak.failures == [], report
    # each fault was met and counted where kvsplice observes it (`inject_faults` waited for
    # each count to grow: per engine for the sidecar's faults, on the probed one for deletes)
    corrupt: dict[str, Any] = counts["corrupt"]  # type: ignore[assignment]
    assert sum(corrupt["corrupt_loads"].values()) == corrupt["injected"] == 2, report
    assert corrupt["still_bad"] == [], report  # each corrupt link gone or stored anew
    deleted: dict[str, Any] = counts["deleted"]  # type: ignore[assignment]
    # a probe looked up, its links deleted while it waited for blocks: one missing load
    assert deleted["landed_while_waiting"] and deleted["injected"] >= 1, report
    assert deleted["missing_loads"]["a"] == deleted["probes"] == 1, report
    sigstop: dict[str, Any] = counts["sigstop"]  # type: ignore[assignment]
    assert min(sigstop["failed_lookups"].values()) >= 1, report
    assert min(sigstop["breaker_trips"].values()) >= 1, report
    for engine in engines.values():
        engine.check_alive()
    wait_until_stored(sidecar, NAMESPACE)
    verify_stored(sidecar, NAMESPACE, engines, prompts[::40])
    return report


# The anchor mode (issue 50): a receiver persona long enough that its first block is its own.
PERSONA_R = " ".join(
    f"Rule {i}: as Rhea, the release manager, you check item {i} of the release list, say "
    f"which item you checked, and keep every answer short."
    for i in range(8)
)
PERSONA_S = "You are Sol, a sender who reads tool output for the others."
TOOL = "\n".join(f"def blend_{i}(xs):\n    return sorted(x + {i} for x in xs)" for i in range(24))
ANCHOR_TASKS = (
    "Which blend function adds 7?",
    "Which blend function adds the largest constant, and what does it return for [3, 1, 2]?",
)
ANCHOR = {"kvsplice": {"reuse": "anchor"}}


def test_the_anchor_mode_falls_back_to_exact_then_loads_its_anchors_corrections(
    engines: dict[str, Engine], sidecar: Sidecar, transcript: TokenTranscript
) -> None:
    """A sender (engine a) read the tool output under its persona; the receiver's persona
    (engine b) was stored by an earlier task. The receiver's first request in the anchor
    mode finds no anchor in its context: the gate refuses, the runs are recomputed (exact
    reuse: the reference's tokens) and become anchors. The same prompt again (engine a, no
    local hit) has each run's own anchor in the pool: the loaded K/V are corrected to what
    the receiver computed in context (report: the anchor mode, approximate tokens, no
    reason), and the answer is the reference's. Negative control (run by hand): anchors made
    with their offsets' sign flipped pass every report check and fail the last (token 7)."""
    for task in ANCHOR_TASKS:
        engines["a"].complete(
            persona_prompt(transcript, PERSONA_S, f"{TOOL}\n\n{task}"), max_tokens=1
        )
    warm = persona_prompt(transcript, PERSONA_R, f"{OTHER_TASK}\n\n{OTHER_TASK}\n\n{OTHER_TASK}")
    engines["b"].complete(warm, max_tokens=1)  # the persona and a whole chunk past it stored
    wait_until_stored(sidecar, NAMESPACE)
    prompt = persona_prompt(transcript, PERSONA_R, f"{TOOL}\n\n{ANCHOR_TASKS[0]}")
    expected = engines["reference"].complete(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)

    refused = engines["b"].complete_with_params(
        prompt, max_tokens=MAX_TOKENS, kv_transfer_params=ANCHOR
    )
    report = (refused.kv_transfer_params or {}).get("kvsplice")
    assert report is not None and report["mode"] == "anchor", report
    assert report["approximate_tokens"] == 0 and "anchor gate refused" in report["reason"], report
    assert refused.token_ids == expected.token_ids  # exact reuse: the reference's tokens
    wait_until_stored(sidecar, NAMESPACE)
    time.sleep(2.0)  # the anchors go out beside the saves

    corrected = engines["a"].complete_with_params(
        prompt, max_tokens=MAX_TOKENS, kv_transfer_params=ANCHOR
    )
    report = (corrected.kv_transfer_params or {}).get("kvsplice")
    assert report is not None and report["mode"] == "anchor" and "reason" not in report, report
    assert report["approximate_tokens"] >= 2 * BLOCK, report
    assert report["exact_tokens"] + report["approximate_tokens"] == full_blocks(prompt)
    assert corrected.token_ids == expected.token_ids
