"""The scheduler half without vLLM: what it promises, loads and saves, driven by fake requests.

The fakes carry only the attributes the connector reads from vLLM's `Request`
and `SchedulerOutput` (vLLM 0.32); the engine tests run the real ones.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from helpers.waiting import wait_for
from scheduler_fakes import (
    BLOCK,
    FINGERPRINT,
    BlockingStore,
    Cached,
    FakeClients,
    FakeRequest,
    FakeStore,
    NewReq,
    Step,
    make_blocking_side,
    make_side,
    with_attrs,
)
from vllm.lora.request import LoRARequest

from kvsplice.common.errors import (
    StoreUnavailable,
)
from kvsplice.common.keys import KeyChain, chunk_links, off_chain_key, root_key
from kvsplice.integrations.vllm.connector_config import salted_namespace
from kvsplice.integrations.vllm.scheduler_side import SchedulerSide
from kvsplice.integrations.vllm.transfer_specs import (
    LoadFaultNews,
    LoadSpec,
    RequestStart,
    SaveSpec,
    WorkerNews,
)


def test_promises_whole_stored_blocks_leaving_one_token_to_compute() -> None:
    prompt = list(range(10, 22))  # 12 tokens = 3 blocks, all stored
    side, store = make_side(prompt)
    assert side.num_new_matched_tokens(FakeRequest("r", prompt), 0) == 8  # not all 12
    assert side.num_new_matched_tokens(FakeRequest("r", prompt), 4) == 4  # beyond local hits
    assert len(store.lookups) == 1  # asked again: the first answer, no second RPC
    longer = [*prompt, 99, 98, 97]
    assert make_side(prompt)[0].num_new_matched_tokens(FakeRequest("r", longer), 0) == 12


def test_a_partly_stored_prompt_gets_its_stored_prefix_only() -> None:
    side, _ = make_side(list(range(10, 22)))
    prompt = [*range(10, 18), 0, 0, 0, 0, 5]  # diverges in block 3
    assert side.num_new_matched_tokens(FakeRequest("r", prompt), 0) == 8


# what `SchedulerSide.build_step` returns: the step's loads, saves and request starts
BuiltStep = tuple[list[LoadSpec], list[SaveSpec], list[RequestStart]]


def promised_and_scheduled(prompt: list[int]) -> tuple[SchedulerSide, BuiltStep]:
    """A side over `prompt`'s stored whole blocks (12 of its 13 tokens) that promised them to
    request "r", was given blocks [7, 3, 9, 1] and scheduled the token left: the side, and
    what that step built."""
    side, _ = make_side(prompt)
    request = FakeRequest("r", prompt)
    assert side.num_new_matched_tokens(request, 0) == 12
    side.after_alloc(request, [7, 3, 9, 1], 12)
    step = side.build_step(Step([NewReq("r", ([7, 3, 9, 1],), 12)], num_scheduled_tokens={"r": 1}))
    return side, step


def test_the_load_names_the_promised_blocks_and_pieces_with_their_parents() -> None:
    prompt = list(range(10, 23))
    side, (loads, _, starts) = promised_and_scheduled(prompt)
    (load,) = loads
    assert [(s.request_id, s.num_prompt_tokens) for s in starts] == [("r", 13)]
    links = chunk_links(FINGERPRINT, prompt, BLOCK)
    assert (load.start, load.end, load.block_ids) == (0, 12, (7, 3, 9))
    assert [(p.start, p.parent_key) for p in load.pieces] == [(0, links[0].parent_key),
        (4, links[1].parent_key), (8, links[2].parent_key)]  # fmt: skip
    assert side.build_step(Step())[0] == []  # a load is handed over once


def test_an_async_load_goes_out_in_the_step_that_promised_it_before_the_request_runs() -> None:
    prompt = list(range(10, 23))
    side, _ = make_side(prompt, load_async="always")
    request = FakeRequest("r", prompt)
    assert side.num_new_matched_tokens(request, 0) == 12
    assert side.is_async_load(request)
    side.after_alloc(request, [7, 3, 9, 1], 12)
    (load,), saves, starts = side.build_step(Step())  # vLLM holds the request back
    assert (load.is_async, load.block_ids, saves, starts) == (True, (7, 3, 9), [], [])
    # once loaded it is scheduled like any new request: no second load, its start reported
    loads, _, starts = side.build_step(
        Step([NewReq("r", ([7, 3, 9, 1],), 12)], num_scheduled_tokens={"r": 1})
    )
    assert loads == [] and [s.request_id for s in starts] == ["r"]


def test_auto_loads_in_the_step_when_idle_and_beside_the_steps_while_others_run() -> None:
    prompt = list(range(10, 23))
    side, _ = make_side(prompt, load_async="auto")
    first = FakeRequest("first", prompt)
    assert side.num_new_matched_tokens(first, 0) == 12 and not side.is_async_load(first)
    side.after_alloc(first, [7, 3, 9, 1], 12)
    (load,), _, _ = side.build_step(
        Step([NewReq("first", ([7, 3, 9, 1],), 12)], num_scheduled_tokens={"first": 1})
    )
    assert not load.is_async  # nothing else ran: loaded in the step
    second = FakeRequest("second", prompt)  # arrives while "first" decodes
    assert side.num_new_matched_tokens(second, 0) == 12 and side.is_async_load(second)
    side.finished(first)
    third = FakeRequest("third", prompt)
    assert side.num_new_matched_tokens(third, 0) == 12 and not side.is_async_load(third)


def test_saves_each_new_full_chunk_once_never_stored_ones_nor_draft_tokens() -> None:
    stored = list(range(10, 18))  # the sidecar holds two chunks
    prompt = stored + list(range(30, 41))  # 19 tokens
    side, _ = make_side(stored)
    request = FakeRequest("r", prompt)
    side.num_new_matched_tokens(request, 0)
    step = Step([NewReq("r", ([0, 1, 2, 3, 4],), 0)], num_scheduled_tokens={"r": 14})
    _, saves, _ = side.build_step(step)
    assert [(s.start, s.end) for s in saves] == [(8, 12)]  # 14 computed: chunk [12, 16) not full
    links = chunk_links(FINGERPRINT, prompt, BLOCK)
    assert saves[0].parent_key == links[1].key and saves[0].block_ids == (2,)
    cached = Cached(["r"], set(), [None], [14])
    step = Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 5},
                scheduled_spec_decode_tokens={"r": [1, 2]})  # fmt: skip
    _, saves, _ = side.build_step(step)  # 19 scheduled, 2 of them drafts: K/V valid up to 17
    assert [(s.start, s.end) for s in saves] == [(12, 16)]
    request.all_token_ids += [50, 51]
    cached = Cached(["r"], set(), [([5],)], [19])
    _, saves, _ = side.build_step(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 2}))
    assert [(s.start, s.end, s.block_ids) for s in saves] == [(16, 20, (4,))]


def test_a_second_request_does_not_put_chunks_this_engine_already_put() -> None:
    prompt = list(range(10, 19))
    side, _ = make_side([])
    for request_id in ("r1", "r2"):
        side.num_new_matched_tokens(FakeRequest(request_id, prompt), 0)
        step = Step([NewReq(request_id, ([0, 1, 2],), 0)], num_scheduled_tokens={request_id: 9})
        saves = side.build_step(step)[1]
        assert len(saves) == (2 if request_id == "r1" else 0)


def test_a_salted_request_looks_up_and_saves_in_its_own_namespace() -> None:
    side, store = make_side(list(range(10, 22)))
    request = FakeRequest("r", list(range(10, 22)), cache_salt="tenant-b")
    side.num_new_matched_tokens(request, 0)
    assert store.lookups[-1][0] == salted_namespace("ns", "tenant-b")
    _, saves, _ = side.build_step(
        Step([NewReq("r", ([0, 1, 2],), 0)], num_scheduled_tokens={"r": 12})
    )
    assert {s.namespace for s in saves} <= {salted_namespace("ns", "tenant-b")}


def test_by_default_only_prompt_positions_are_saved() -> None:
    prompt = list(range(10, 16))  # 6 prompt tokens, then decoding
    side, _ = make_side([], save_decode=False)
    request = FakeRequest("r", list(prompt))
    side.num_new_matched_tokens(request, 0)
    assert side.build_step(Step([NewReq("r", ([0, 1],), 0)], num_scheduled_tokens={"r": 6}))[1]
    request.all_token_ids += [1, 2, 3]  # decoded: positions 6..8 written one at a time
    cached = Cached(["r"], set(), [None], [6])
    assert (
        side.build_step(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 3}))[1] == []
    )


# ---- issue 33: lookups off the loop, faults, acknowledgements, what keys name -------------


def test_a_resumed_request_that_loads_reports_its_hits() -> None:
    prompt = list(range(10, 23))
    side, _ = make_side(prompt)
    request = FakeRequest("r", prompt)
    side.num_new_matched_tokens(request, 0)
    side.build_step(Step([NewReq("r", ([0, 1, 2, 3],), 0)], num_scheduled_tokens={"r": 13}))
    request.all_token_ids += [1]  # preempted after a token, then resumed: looked up again
    assert side.num_new_matched_tokens(request, 0) == 12
    side.after_alloc(request, [5, 6, 7, 8], 12)
    cached = Cached(["r"], {"r"}, [([5, 6, 7, 8],)], [12])
    loads, _, starts = side.build_step(
        Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 2})
    )
    assert len(loads) == 1 and [(s.request_id, s.num_prompt_tokens) for s in starts] == [("r", 0)]


def test_a_request_its_local_hit_covers_is_not_looked_up_nor_puts_what_the_sidecar_holds() -> None:
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    side, store = make_side(prompt)
    assert side.num_new_matched_tokens(FakeRequest("r1", prompt), 0) == 12
    # r2: vLLM's prefix cache already holds the 12 tokens the sidecar could add
    assert side.num_new_matched_tokens(FakeRequest("r2", prompt), 12) == 0
    assert len(store.lookups) == 1
    step = Step([NewReq("r2", ([4, 5, 6, 7],), 12)], num_scheduled_tokens={"r2": 1})
    assert side.build_step(step)[1] == []  # found stored by r1's lookup: not put again


def test_a_tls_failure_is_named_as_tls_not_as_an_outage() -> None:
    handshake = StoreUnavailable(
        "store answered UNAVAILABLE: Ssl handshake failed: CERTIFICATE_VERIFY_FAILED"
    )
    store = BlockingStore(list(range(10, 22)), error=handshake)
    store.release.set()
    side = make_blocking_side(store, lookup_wait_s=5.0)
    assert side.num_new_matched_tokens(FakeRequest("r", list(range(10, 22))), 0) == 0
    assert any("TLS" in kind for kind in side.faults.counts)


def test_a_half_chunk_tail_is_saved_once_its_blocks_exist_and_found_by_the_next_lookup() -> None:
    """Chunks of 2 blocks: a request's last half chunk (1 block) is stored once computed,
    once; the full chunk follows when it fills; `save_tails=False` stores full chunks only."""
    chunk = 2 * BLOCK
    store = FakeStore([])
    side = SchedulerSide(FakeClients(store), FINGERPRINT, BLOCK, chunk, save_decode=True,
                         lookup_wait_s=10.0)  # type: ignore[arg-type]  # fmt: skip
    request = FakeRequest("r", list(range(10, 23)))  # 13 tokens: 1 chunk, 1 block, 1 token
    side.num_new_matched_tokens(request, 0)
    step = Step([NewReq("r", ([0, 1, 2, 3],), 0)], num_scheduled_tokens={"r": 13})
    saves = side.build_step(step)[1]
    assert [(s.start, s.end, s.block_ids) for s in saves] == [(0, 8, (0, 1)), (8, 12, (2,))]
    tail = saves[1]
    chain = KeyChain(FINGERPRINT)
    chain.extend(request.all_token_ids[:8])
    assert (
        tail.parent_key == saves[0].key
        and tail.key == chain.extend(request.all_token_ids[8:12]).key
    )
    request.all_token_ids += [50, 51]  # decoding: the same tail is not saved again
    cached = Cached(["r"], set(), [None], [13])
    assert (
        side.build_step(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1}))[1] == []
    )
    request.all_token_ids += [52, 53]
    cached = Cached(["r"], set(), [None], [14])
    saves = side.build_step(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 3}))[1]
    assert [(s.start, s.end) for s in saves] == [(8, 16)]  # the full chunk; its tail is past 17

    plain = SchedulerSide(FakeClients(FakeStore([])), FINGERPRINT, BLOCK, chunk, save_decode=True,
                          save_tails=False, lookup_wait_s=10.0)  # type: ignore[arg-type]  # fmt: skip
    other = FakeRequest("o", list(range(10, 23)))
    plain.num_new_matched_tokens(other, 0)
    step = Step([NewReq("o", ([0, 1, 2, 3],), 0)], num_scheduled_tokens={"o": 13})
    assert [(s.start, s.end) for s in plain.build_step(step)[1]] == [(0, 8)]


def test_past_the_fence_chunks_are_saved_off_chain_after_the_exact_part_s_tail() -> None:
    """A gated promise fenced the request at token 4 (mid-chunk, a block edge): its exact
    half chunk is saved on the chain; everything computed from the chunk holding the fence
    on goes off-chain (no exact key), also after a load fault rewinds the chain there."""
    chunk = 2 * BLOCK
    side = SchedulerSide(FakeClients(FakeStore([])), FINGERPRINT, BLOCK, chunk, save_decode=True,
                         lookup_wait_s=10.0)  # type: ignore[arg-type]  # fmt: skip
    request = FakeRequest("r", list(range(10, 31)))  # 21 tokens
    side.num_new_matched_tokens(request, 0)
    side._tracked["r"].fence.place(request, 4, BLOCK)  # what a promise of runs from 4 does
    step = Step([NewReq("r", ([0, 1, 2, 3, 4, 5],), 0)], num_scheduled_tokens={"r": 21})
    saves = side.build_step(step)[1]
    assert [(s.start, s.end) for s in saves] == [(0, 4), (0, 8), (8, 16), (16, 20)]
    exact = KeyChain(FINGERPRINT)
    assert saves[0].key == exact.extend(request.all_token_ids[:4]).key  # the exact tail
    assert saves[1].parent_key == off_chain_key(root_key(FINGERPRINT))
    assert [s.parent_key for s in saves[2:]] == [saves[1].key, saves[2].key]
    on_chain = {link.key for link in chunk_links(FINGERPRINT, request.all_token_ids, BLOCK)}
    on_chain |= {link.key for link in chunk_links(FINGERPRINT, request.all_token_ids, chunk)}
    assert not {s.key for s in saves[1:]} & on_chain
    assert [s.exact for s in saves] == [True, False, False, False]  # what `ls` shows

    side.absorb(WorkerNews(failed=[(s.namespace, s.key) for s in saves]))  # not stored
    side.absorb(WorkerNews(faults=[LoadFaultNews("r", saves[0].namespace, 12)]))
    cached = Cached(["r"], set(), [None], [8])  # vLLM recomputes from 8
    again = side.build_step(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 13}))[1]
    assert [(s.start, s.key) for s in again][:1] == [(8, saves[2].key)]  # still off-chain


class SlowSimilarStore(FakeStore):
    """A sidecar whose content search is slow and finds nothing."""

    num_similar: int = 0

    def find_similar(
        self, root: str, window: list[int], limit: int, with_token_ids: bool = False
    ) -> list[object]:
        self.num_similar += 1
        time.sleep(0.3)
        return []


def test_a_slow_content_search_stops_in_time_and_the_exact_prefix_stands() -> None:
    """Past half the lookup deadline the approximate search stops: a gated request keeps its
    exact prefix (4 windows of 0.3 s would pass the 1 s deadline: a miss, nothing loaded)."""
    stored = list(range(10, 18))
    store = SlowSimilarStore(stored)
    side = SchedulerSide(FakeClients(store), FINGERPRINT, BLOCK, BLOCK, engine_modes=("naive",),
                         lookup_wait_s=0.01, lookup_timeout_s=1.0)  # type: ignore[arg-type]  # fmt: skip
    request = FakeRequest("r", [*stored, *range(100, 140)])
    request.kv_transfer_params = {"kvsplice": {"reuse": "gated"}}  # type: ignore[attr-defined]
    found = wait_for(
        lambda: side.num_new_matched_tokens(request, 0), lambda n: n is not None, timeout_s=30.0
    )
    assert found == 8 and 1 <= store.num_similar < 4
    assert side.faults.counts["looking up approximate runs stopped"] == 1


def test_lora_and_image_requests_have_their_own_chain_prompt_embeds_share_nothing(
    tmp_path: Path,
) -> None:
    prompt = list(range(10, 22))
    side, store = make_side(prompt)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights")
    lora = LoRARequest("sql", 1, str(tmp_path))
    image = SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=2, length=4))
    plain = side.num_new_matched_tokens(FakeRequest("plain", prompt), 0)
    with_lora = side.num_new_matched_tokens(with_attrs(FakeRequest("l", prompt), lora), 0)
    with_image = side.num_new_matched_tokens(with_attrs(FakeRequest("i", prompt), None, [image]), 0)
    assert plain == 8 and with_lora == 0 and with_image == 0  # the plain chain does not serve them
    assert len(set(store.roots)) == 3 and store.roots[0] == FINGERPRINT
    embeds = with_attrs(FakeRequest("e", [0] * 12), None, [], prompt_embeds=object())
    assert side.num_new_matched_tokens(embeds, 0) == 0 and len(store.lookups) == 3
    step = Step([NewReq("e", ([0, 1, 2],), 0)], num_scheduled_tokens={"e": 12})
    assert side.build_step(step)[1] == []  # never saved
    step = Step([NewReq("l", ([3, 4, 5],), 0)], num_scheduled_tokens={"l": 12})
    lora_saves = side.build_step(step)[1]
    assert lora_saves and {s.root for s in lora_saves} == {store.roots[1]}
