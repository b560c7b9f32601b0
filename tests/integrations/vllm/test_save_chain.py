"""One request's save chain: full chunks, half-chunk tails, the prompt-only rule, rewinding."""

from __future__ import annotations

from kvsplice.common.keys import KeyChain, chunk_links
from kvsplice.integrations.vllm.fence import Fence
from kvsplice.integrations.vllm.save_chain import SaveChain, SaveRules
from kvsplice.integrations.vllm.save_ledger import SaveLedger

FINGERPRINT = "kvfp1-" + "ef" * 16
BLOCK, CHUNK = 4, 8
TOKENS = tuple(range(500, 530))  # 30 tokens


def make_chain(save_tails: bool = True, save_decode: bool = True) -> SaveChain:
    rules = SaveRules.of(BLOCK, CHUNK, save_tails, save_decode)
    return SaveChain("r", "ns", FINGERPRINT, rules, Fence())


def spans(specs: list) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in specs]


def test_full_chunks_are_planned_once_each_with_their_blocks_and_chain_keys() -> None:
    saves, ledger = make_chain(save_tails=False), SaveLedger()
    specs = saves.plan(TOKENS, len(TOKENS), 20, list(range(8)), ledger)
    links = chunk_links(FINGERPRINT, TOKENS, CHUNK)
    assert spans(specs) == [(0, 8), (8, 16)]
    assert [(s.parent_key, s.key, s.exact) for s in specs] == [
        (link.parent_key, link.key, True) for link in links[:2]
    ]
    assert specs[1].block_ids == (2, 3) and specs[0].block_table is specs[1].block_table
    assert saves.plan(TOKENS, len(TOKENS), 20, list(range(8)), ledger) == []  # planned already
    assert spans(saves.plan(TOKENS, len(TOKENS), 24, list(range(8)), ledger)) == [(16, 24)]


def test_a_half_chunk_tail_is_planned_once_per_chunk_position() -> None:
    saves, ledger = make_chain(), SaveLedger()
    specs = saves.plan(TOKENS, len(TOKENS), 13, list(range(8)), ledger)
    assert spans(specs) == [(0, 8), (8, 12)]  # the tail of the second chunk: one block
    assert saves.plan(TOKENS, len(TOKENS), 14, list(range(8)), ledger) == []


def test_only_prompt_positions_unless_decoded_ones_are_saved_too() -> None:
    prompt_only = make_chain(save_tails=False, save_decode=False)
    assert spans(prompt_only.plan(TOKENS, 10, 30, list(range(8)), SaveLedger())) == [(0, 8)]
    everything = make_chain(save_tails=False)
    assert len(everything.plan(TOKENS, 10, 30, list(range(8)), SaveLedger())) == 3


def test_what_the_lookup_found_and_what_others_put_is_not_planned() -> None:
    saves, ledger = make_chain(save_tails=False), SaveLedger()
    first = KeyChain(FINGERPRINT).extend(TOKENS[:CHUNK])
    saves.found(frozenset({first.key}), ledger.seq)
    second = chunk_links(FINGERPRINT, TOKENS, CHUNK)[1]
    assert ledger.claim(("ns", second.key), 0)  # another request is putting it
    assert saves.plan(TOKENS, len(TOKENS), 16, list(range(8)), ledger) == []


def test_rewinding_goes_back_to_a_chunk_edge_and_plans_those_chunks_again() -> None:
    saves, ledger = make_chain(save_tails=False), SaveLedger()
    specs = saves.plan(TOKENS, len(TOKENS), 24, list(range(8)), ledger)
    ledger.fail([(s.namespace, s.key) for s in specs])  # none stored
    saves.rewind(13, TOKENS)  # a load fault at token 13: recomputed from the chunk edge 8
    assert saves.chain.position == CHUNK
    again = saves.plan(TOKENS, len(TOKENS), 24, list(range(8)), ledger)
    assert [(s.start, s.key) for s in again] == [(s.start, s.key) for s in specs[1:]]
    saves.rewind(100, TOKENS)  # never forward
    assert saves.chain.position == 24
