"""One request's save chain: which of its chunks and half-chunk tails to put, as `SaveSpec`s.

The chain hangs from the request's root and moves a chunk at a time; from the request's
approximate fence on it goes off-chain for good (`Fence`), and each spec says whether its
chain was still exact. Knows chunk shapes, keys and the fence; not vLLM (the caller says
how many tokens are ready), and asks `SaveLedger` whether anyone else puts a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.common.keys import ChainLink, KeyChain
from kvsplice.integrations.vllm.fence import Fence
from kvsplice.integrations.vllm.save_ledger import SaveLedger
from kvsplice.integrations.vllm.transfer_specs import SaveSpec


@dataclass(frozen=True)
class SaveRules:
    """What is saved: chunks of `chunk_tokens`, half-chunk tails, and (`save_decode`)
    the positions the engine decoded, not only the prompt's.

    NOTE: by default only prompt positions are saved. K/V the engine wrote one token at
    a time while decoding differs in its last bits from what a prefill of the same
    tokens writes (other kernels), and in bf16 that is enough to change a later greedy
    token; a transcript's next agent prefills those answer tokens and stores them then.
    `save_decode` stores them at once (more reuse, outputs then match a recompute only
    up to that rounding, as with vLLM's own prefix cache).
    """

    block_size: int
    chunk_tokens: int
    tail_tokens: int  # a half chunk in whole blocks (0: no tails)
    save_decode: bool

    @classmethod
    def of(
        cls, block_size: int, chunk_tokens: int, save_tails: bool, save_decode: bool
    ) -> SaveRules:
        tail_tokens = chunk_tokens // 2 // block_size * block_size if save_tails else 0
        return cls(block_size, chunk_tokens, tail_tokens, save_decode)


class SaveChain:
    def __init__(
        self, request_id: str, namespace: str, root: str, rules: SaveRules, fence: Fence,
        session_id: str = "",
    ) -> None:  # fmt: skip
        self.request_id, self.namespace, self.root = request_id, namespace, root
        self.session_id = session_id  # what its puts are held for (empty: none)
        self.rules = rules
        self.fence = fence
        self.chain = KeyChain(root)
        self.tail_saved_at = -1  # the chain position whose half-chunk tail was saved
        self.held_keys: frozenset[bytes] = frozenset()  # found stored by the last lookup
        self.lookup_seq = 0  # the ledger's round when that lookup answered

    def found(self, held_keys: frozenset[bytes], lookup_seq: int) -> None:
        """The request's lookup answered: `held_keys` are stored, not put again."""
        self.held_keys, self.lookup_seq = held_keys, lookup_seq

    def plan(
        self, token_ids: Sequence[int], num_prompt_tokens: int, num_computed: int,
        block_ids: Sequence[int], ledger: SaveLedger,
    ) -> list[SaveSpec]:  # fmt: skip
        """The chunks whose K/V the engine holds up to token `num_computed` (prompt tokens
        only, unless `save_decode`), not stored and nobody else putting them.

        A chunk reaching past the fence was computed over approximate K/V: from there the
        chain goes off-chain for good (`common.keys.off_chain_key`), so no exact lookup ever
        returns it, while a later request that opted in finds it by content (the next agent
        of a persona-first pipeline then finds the quoting text and the answers this request
        computed). Before leaving, the exact part gets its half-chunk tail if it has one.
        """
        ready = min(num_computed, len(token_ids))
        if not self.rules.save_decode:
            ready = min(ready, num_prompt_tokens)
        chain, chunk = self.chain, self.rules.chunk_tokens
        links: list[tuple[ChainLink, bool]] = []  # (link, its chain exact)
        while chain.position + chunk <= ready:
            end = chain.position + chunk
            if self.fence.crossed_by(chain, end):
                assert self.fence.position is not None
                exact_tail = self._tail(token_ids, min(ready, self.fence.position), ledger)
                links += [exact_tail] if exact_tail else []
                self.fence.leave_exact_at(chain, end)
                self.tail_saved_at = -1  # the off-chain tail at this position is another
            link = chain.extend(token_ids[chain.position : end])
            if self._claim(link, ledger):
                links.append((link, chain.exact))
        tail = self._tail(token_ids, ready, ledger)
        links += [tail] if tail else []
        table = tuple(block_ids) if links else ()  # one table shared by this step's saves
        return [self._spec(link, exact, token_ids, table) for link, exact in links]

    def rewind(self, position: int, token_ids: Sequence[int]) -> None:
        """Move the chain back to `position`, rounded down to a chunk edge (never forward):
        vLLM recomputes from there, and those chunks are saved once computed again."""
        chunk = self.rules.chunk_tokens
        target = min(self.chain.position, position // chunk * chunk)
        chain = KeyChain(self.root)
        while chain.position < target:
            self.fence.leave_exact_at(chain, chain.position + chunk)
            chain.extend(token_ids[chain.position : chain.position + chunk])
        self.chain, self.held_keys, self.tail_saved_at = chain, frozenset(), -1

    def _tail(
        self, token_ids: Sequence[int], ready: int, ledger: SaveLedger
    ) -> tuple[ChainLink, bool] | None:
        """The half-chunk segment past the chain's last full chunk, once its blocks exist.

        NOTE: chunks keep puts few and large, but a request's last partial chunk would
        then never be stored: the next agent of a transcript (this one's prompt and
        answer, then more) would recompute up to a chunk less than vLLM's own prefix
        cache holds. One half-chunk tail per chunk (whole blocks) halves that, for at
        most half a chunk more bytes; the full chunk is stored when it fills.
        """
        chain, tail_tokens = self.chain, self.rules.tail_tokens
        end = chain.position + tail_tokens
        if not tail_tokens or end > ready or self.tail_saved_at == chain.position:
            return None
        self.fence.leave_exact_at(chain, end)
        self.tail_saved_at = chain.position
        link = chain.peek(token_ids[chain.position : end])
        return (link, chain.exact) if self._claim(link, ledger) else None

    def _claim(self, link: ChainLink, ledger: SaveLedger) -> bool:
        return link.key not in self.held_keys and ledger.claim(
            (self.namespace, link.key), self.lookup_seq
        )

    def _spec(
        self, link: ChainLink, exact: bool, token_ids: Sequence[int], table: tuple[int, ...]
    ) -> SaveSpec:
        return SaveSpec(
            request_id=self.request_id, namespace=self.namespace, root=self.root,
            start=link.start, token_ids=tuple(token_ids[link.start : link.end]),
            parent_key=link.parent_key, key=link.key, block_table=table,
            block_size=self.rules.block_size, exact=exact, session_id=self.session_id,
        )  # fmt: skip
