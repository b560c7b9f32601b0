"""The approximate fence: vLLM's hashes replaced from its block on, chains leaving it off-chain,
and the chunks stored past it say they are not exact (`SegmentMeta.exact`)."""

from __future__ import annotations

from types import SimpleNamespace

from helpers.vllm_worker import BLOCK, FINGERPRINT, NS, FakeStore, make_worker

from kvsplice.common.keys import KeyChain, off_chain_key, root_key
from kvsplice.integrations.vllm.fence import Fence
from kvsplice.integrations.vllm.save_chain import SaveChain, SaveRules
from kvsplice.integrations.vllm.save_ledger import SaveLedger


def test_placing_the_fence_rewrites_the_hashes_from_its_block_on_and_keeps_the_earliest() -> None:
    hashes = [bytes([i]) * 32 for i in range(4)]
    request = SimpleNamespace(block_hashes=list(hashes))
    fence = Fence()
    fence.place(request, 2 * BLOCK, BLOCK)
    assert request.block_hashes[:2] == hashes[:2]  # exact K/V: still shared
    assert not set(request.block_hashes[2:]) & set(hashes)
    fence.place(request, 3 * BLOCK, BLOCK)
    assert fence.position == 2 * BLOCK
    fence.place(SimpleNamespace(), BLOCK, BLOCK)  # a request without hashes
    assert fence.position == BLOCK


def test_a_chain_leaves_exact_at_the_first_link_past_the_fence() -> None:
    fence, chain = Fence(), KeyChain(FINGERPRINT)
    fence.leave_exact_at(chain, 100)
    assert chain.exact  # no fence
    fence.position = 6
    fence.leave_exact_at(chain, 6)
    assert chain.exact  # ends at the fence: exact
    assert fence.crossed_by(chain, 7)
    fence.leave_exact_at(chain, 7)
    assert not chain.exact and chain.parent == off_chain_key(root_key(FINGERPRINT))
    assert not fence.crossed_by(chain, 8)  # left once, for good


def test_chunks_saved_past_an_approximate_fence_are_stored_not_exact() -> None:
    """Fenced at token 8 of 20: the two chunks before are stored exact=True, the ones after
    (computed over approximate K/V) exact=False, off-chain."""
    fence = Fence()
    fence.place(SimpleNamespace(), 2 * BLOCK, BLOCK)
    tokens = tuple(range(300, 320))
    saves = SaveChain("r", NS, FINGERPRINT, SaveRules.of(BLOCK, BLOCK, False, True), fence)
    specs = saves.plan(tokens, len(tokens), len(tokens), list(range(5)), SaveLedger())
    assert [(s.start, s.exact) for s in specs] == [
        (0, True), (4, True), (8, False), (12, False), (16, False)
    ]  # fmt: skip
    store = FakeStore()
    worker = make_worker(store)
    for spec in specs:
        worker.save(spec, 0)
    assert worker.putter.flush() and len(worker.take_news(0).acked) == len(specs)
    stored = {meta.start_position: meta.exact for meta, _ in store.segments.values()}
    assert stored == {0: True, 4: True, 8: False, 12: False, 16: False}
