"""Similarity index: MinHash LSH candidates, then verification on real token ids.

One LSH per (namespace, fingerprint, signature kind) keeps tenants and models
apart. Beside the LSH, segments are found by their exact tokens and by their first
`HEAD_TOKENS` tokens (a segment that begins as the query does: the same system prompt,
then other text, which a Jaccard over the whole window misses). It finds and ranks
candidates and reports what matches exactly; the
admission decision (W_exact guard, modes) belongs to the client's policy.
Not thread-safe: call it from one thread (the server's event loop).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from datasketch import MinHashLSH

from kvsplice.common.keys import content_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.index.signature import Signature, SignatureKind
from kvsplice.index.signature_table import SignatureTable
from kvsplice.index.similarity_config import SimilarityConfig

logger = logging.getLogger(__name__)

# A segment is also a candidate for a query that starts with its first this many tokens.
HEAD_TOKENS = 16


@dataclass(frozen=True)
class SimilarMatch:
    """A candidate and what verification on real token ids found.

    `exact_window`: how many tokens right before the candidate equal the
    query's left context (the input of the depth-aware guard W_exact(L_cut));
    the candidate's whole left context (`start_position`) when the chained
    parent keys match.
    """

    meta: SegmentMeta
    estimated_jaccard: float
    exact_tokens: bool
    same_left_context: bool
    exact_window: int


@dataclass(frozen=True)
class _Entry:
    meta: SegmentMeta
    kind: SignatureKind


@dataclass(frozen=True)
class _LshGroup:
    """The LSH buckets and signature rows of one (namespace, fingerprint, kind)."""

    lsh: MinHashLSH
    table: SignatureTable


_LshKey = tuple[str, str, SignatureKind]  # namespace, fingerprint, kind
_ContentKey = tuple[str, str, bytes]  # namespace, fingerprint, content key


def common_suffix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common suffix of `a` and `b` (tuple slices, binary search)."""
    left, right = tuple(a), tuple(b)
    lo, hi = 0, min(len(left), len(right))
    # NOTE: "the last k match" is monotone in k, so binary search over k is exact.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if left[len(left) - mid :] == right[len(right) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SimilarityIndex:
    """MinHash LSH over segments, isolated per (namespace, fingerprint)."""

    def __init__(self, config: SimilarityConfig | None = None) -> None:
        self.config = config or SimilarityConfig()
        self._signer = self.config.build_signer()
        self._entries: dict[tuple[str, bytes], _Entry] = {}
        self._groups: dict[_LshKey, _LshGroup] = {}
        self._context_keys_by_content: dict[_ContentKey, set[bytes]] = {}
        self._context_keys_by_head: dict[_ContentKey, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def signature(self, meta: SegmentMeta) -> bytes:
        """Persistable signature of `meta`; pass it back to `add` to skip rehashing."""
        return self._signer.to_bytes(self._signer.sign_meta(meta))

    def add(self, meta: SegmentMeta, signature: bytes | None = None) -> None:
        """Index `meta` (replacing the same (namespace, context_key)). A `signature`
        from `self.signature(meta)` is reused; one built with other parameters
        or malformed is ignored and `meta` is re-signed."""
        parsed = self._signer.from_bytes(signature) if signature is not None else None
        if parsed is None and signature is not None:
            logger.debug("stale signature for segment %s; re-signing", meta.segment_id)
        self._insert(meta, parsed or self._signer.sign_meta(meta))

    def remove(self, namespace: str, context_key: bytes) -> bool:
        """Forget a segment; `False` if it was not indexed."""
        entry = self._entries.pop((namespace, context_key), None)
        if entry is None:
            return False
        meta = entry.meta
        group_key = (namespace, meta.model_fingerprint, entry.kind)
        group = self._groups[group_key]
        group.lsh.remove(context_key)
        group.table.remove(context_key)
        if not group.table:
            del self._groups[group_key]
        content = (namespace, meta.model_fingerprint, meta.content_key)
        _discard(self._context_keys_by_content, content, context_key)
        head = _head_key(namespace, meta.model_fingerprint, meta.token_ids)
        if head is not None:
            _discard(self._context_keys_by_head, head, context_key)
        return True

    def find_similar(
        self,
        namespace: str,
        fingerprint: str,
        token_ids: Sequence[int],
        *,
        text: str = "",
        left_context_ids: Sequence[int] = (),
        parent_key: bytes | None = None,
        limit: int = 8,
    ) -> list[SimilarMatch]:
        """Up to `limit` verified candidates, best first.

        Candidates: segments with exactly these tokens (by content key, always
        verified, whatever their number) plus the best `max_candidates` LSH hits
        at or above `min_jaccard`, probed with the text signature (if `text`)
        and the token signature. Order: exact tokens first — among them same
        left context, then longer `exact_window` — then higher Jaccard.
        """
        query_tokens = tuple(token_ids)
        jaccard_by_key = self._lsh_candidates(namespace, fingerprint, query_tokens, text)
        if query_tokens:
            jaccard_by_key.update(self._same_head_candidates(namespace, fingerprint, query_tokens))
            jaccard_by_key.update(self._same_token_candidates(namespace, fingerprint, query_tokens))
        left_context = tuple(left_context_ids)
        matches = [
            self._verify(
                self._entries[(namespace, key)].meta,
                jaccard,
                query_tokens,
                left_context,
                parent_key,
            )
            for key, jaccard in jaccard_by_key.items()
        ]
        matches.sort(key=_match_rank)
        return matches[:limit]

    def _insert(self, meta: SegmentMeta, signature: Signature) -> None:
        self.remove(meta.namespace, meta.context_key)
        group_key = (meta.namespace, meta.model_fingerprint, signature.kind)
        group = self._groups.get(group_key)
        if group is None:
            lsh = _new_lsh(self.config.threshold, self.config.num_perm)
            group = self._groups[group_key] = _LshGroup(lsh, SignatureTable(self.config.num_perm))
        group.lsh.insert(meta.context_key, signature.minhash, check_duplication=False)
        group.table.put(meta.context_key, signature.minhash.hashvalues)
        self._entries[(meta.namespace, meta.context_key)] = _Entry(meta, signature.kind)
        content = (meta.namespace, meta.model_fingerprint, meta.content_key)
        self._context_keys_by_content.setdefault(content, set()).add(meta.context_key)
        head = _head_key(meta.namespace, meta.model_fingerprint, meta.token_ids)
        if head is not None:
            self._context_keys_by_head.setdefault(head, set()).add(meta.context_key)

    def _same_token_candidates(
        self, namespace: str, fingerprint: str, token_ids: tuple[int, ...]
    ) -> dict[bytes, float]:
        """Segments with exactly `token_ids` (content key, then the ids themselves):
        the true Jaccard of identical token sets is 1."""
        same_content = self._context_keys_by_content.get(
            (namespace, fingerprint, content_key(token_ids)), ()
        )
        return {
            key: 1.0
            for key in same_content
            if self._entries[(namespace, key)].meta.token_ids == token_ids
        }

    def _same_head_candidates(
        self, namespace: str, fingerprint: str, token_ids: tuple[int, ...]
    ) -> dict[bytes, float]:
        """Segments whose first `HEAD_TOKENS` tokens are the query's first, with the true
        Jaccard of the two token sets (what the LSH estimates for its own candidates).

        NOTE: at most `max_candidates` of them, as for the LSH: every chunk that starts with
        a shared system prompt has the same head, and this runs on the server's event loop.
        """
        head = _head_key(namespace, fingerprint, token_ids)
        found = self._context_keys_by_head.get(head, ()) if head is not None else ()
        query = set(token_ids)
        scores = {}
        for key in itertools.islice(found, self.config.max_candidates):
            tokens = self._entries[(namespace, key)].meta.token_ids
            if tokens[:HEAD_TOKENS] == token_ids[:HEAD_TOKENS]:
                mine = set(tokens)
                scores[key] = len(query & mine) / len(query | mine)
        return scores

    def _lsh_candidates(
        self, namespace: str, fingerprint: str, token_ids: tuple[int, ...], text: str
    ) -> dict[bytes, float]:
        """Context key -> estimated Jaccard of the best `max_candidates` LSH hits."""
        probes = [self._signer.sign_text(text)] if text else []
        if token_ids:
            probes.append(self._signer.sign_tokens(token_ids))
        keys: list[bytes] = []
        jaccards: list[np.ndarray] = []
        # NOTE: a segment sits in exactly one kind's LSH, so probes never return the same key.
        for probe in probes:
            if probe is not None:
                probe_keys, probe_jaccards = self._probe(namespace, fingerprint, probe)
                keys += probe_keys
                jaccards.append(probe_jaccards)
        if not keys:
            return {}
        all_jaccards = np.concatenate(jaccards)
        kept = np.flatnonzero(all_jaccards >= self.config.min_jaccard)
        if len(kept) > self.config.max_candidates:
            # Top-k without sorting every candidate (templated workloads return many).
            top = np.argpartition(-all_jaccards[kept], self.config.max_candidates - 1)
            kept = kept[top[: self.config.max_candidates]]
        return {keys[i]: float(all_jaccards[i]) for i in kept.tolist()}

    def _probe(
        self, namespace: str, fingerprint: str, probe: Signature
    ) -> tuple[list[bytes], np.ndarray]:
        """LSH hits of `probe` and their estimated Jaccard (MinHash.jaccard, vectorized)."""
        group = self._groups.get((namespace, fingerprint, probe.kind))
        keys = group.lsh.query(probe.minhash) if group is not None else []
        if group is None or not keys:
            return [], np.empty(0)
        return keys, group.table.jaccard(keys, probe.minhash.hashvalues)

    @staticmethod
    def _verify(
        meta: SegmentMeta,
        jaccard: float,
        query_tokens: tuple[int, ...],
        left_context: tuple[int, ...],
        parent_key: bytes | None,
    ) -> SimilarMatch:
        same_left_context = parent_key is not None and meta.parent_key == parent_key
        if same_left_context:
            exact_window = meta.start_position
        else:
            exact_window = common_suffix_len(left_context, meta.left_tail_ids)
        return SimilarMatch(
            meta=meta,
            estimated_jaccard=jaccard,
            exact_tokens=meta.token_ids == query_tokens,
            same_left_context=same_left_context,
            exact_window=exact_window,
        )


def _head_key(namespace: str, fingerprint: str, token_ids: Sequence[int]) -> _ContentKey | None:
    if len(token_ids) < HEAD_TOKENS:
        return None
    return (namespace, fingerprint, content_key(token_ids[:HEAD_TOKENS]))


def _discard(index: dict[_ContentKey, set[bytes]], key: _ContentKey, context_key: bytes) -> None:
    keys = index[key]
    keys.discard(context_key)
    if not keys:
        del index[key]


def _match_rank(match: SimilarMatch) -> tuple[bool, bool, int, float, bytes]:
    exact = match.exact_tokens
    return (
        not exact,
        not (exact and match.same_left_context),
        -match.exact_window if exact else 0,
        -match.estimated_jaccard,
        match.meta.context_key,
    )


def _new_lsh(threshold: float, num_perm: int) -> MinHashLSH:
    """An empty LSH with the bands `_lsh_bands` picked for these parameters."""
    return MinHashLSH(
        threshold=threshold, num_perm=num_perm, params=_lsh_bands(threshold, num_perm)
    )


# NOTE: MinHashLSH picks its bands by numeric integration, ~0.2 s of CPU on the event loop
# (a put that made a namespace's first segment paid it, again after its last was removed).
# They depend on the parameters alone: picked once per process.
@functools.cache
def _lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    return lsh.b, lsh.r
