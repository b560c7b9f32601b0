"""Exact index: a trie of segments linked by chained context keys.

A run of segments matches a prompt when each one's parent is the previous
one's context key (the first's is the fingerprint's root key) and its token ids
equal the prompt's at its place — checked on the ids, never on a hash alone.
It owns only metadata; payload bytes live in the store. Not thread-safe.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.common.keys import context_key, root_key
from kvsplice.common.segment import SegmentMeta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExactIndexConfig:
    """`max_search_nodes` bounds how many segments `lookup_prefix` visits after
    the greedy run (which is always completed) looking for a longer run."""

    max_search_nodes: int = 256

    def __post_init__(self) -> None:
        if self.max_search_nodes < 1:
            raise ValueError(f"max_search_nodes {self.max_search_nodes} must be >= 1")


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored run covering the prompt from position 0."""

    segments: tuple[SegmentMeta, ...]
    num_matched_tokens: int


_NO_MATCH = PrefixMatch((), 0)
_ChildKey = tuple[str, bytes]  # namespace, parent key


def _longest_first(meta: SegmentMeta) -> int:
    return -meta.num_tokens


class ExactIndex:
    """Segments by (namespace, context_key), and children by (namespace, parent_key)."""

    def __init__(self, config: ExactIndexConfig | None = None) -> None:
        self.config = config or ExactIndexConfig()
        self._segments: dict[tuple[str, bytes], SegmentMeta] = {}
        # children[(namespace, parent_key)][first_token] = metas, longest first
        self._children: dict[_ChildKey, dict[int, list[SegmentMeta]]] = {}
        self._lengths: dict[str, Counter[int]] = {}  # segments per length, per namespace

    def __len__(self) -> int:
        return len(self._segments)

    def get(self, namespace: str, context_key: bytes) -> SegmentMeta | None:
        return self._segments.get((namespace, context_key))

    def add(self, meta: SegmentMeta) -> None:
        """Index `meta`; idempotent, replaces an entry with the same (namespace, context_key)."""
        self.remove(meta.namespace, meta.context_key)
        self._segments[(meta.namespace, meta.context_key)] = meta
        by_first = self._children.setdefault((meta.namespace, meta.parent_key), {})
        siblings = by_first.setdefault(meta.token_ids[0], [])
        bisect.insort(siblings, meta, key=_longest_first)
        self._lengths.setdefault(meta.namespace, Counter())[meta.num_tokens] += 1

    def remove(self, namespace: str, context_key: bytes) -> bool:
        """Forget a segment; `False` if it was not indexed. Its children stay
        indexed but become unreachable until it is added again."""
        meta = self._segments.pop((namespace, context_key), None)
        if meta is None:
            return False
        child_key = (namespace, meta.parent_key)
        by_first = self._children[child_key]
        siblings = by_first[meta.token_ids[0]]
        siblings[:] = [m for m in siblings if m.context_key != context_key]
        if not siblings:
            del by_first[meta.token_ids[0]]
        if not by_first:
            del self._children[child_key]
        lengths = self._lengths[namespace]
        lengths[meta.num_tokens] -= 1
        if lengths[meta.num_tokens] == 0:
            del lengths[meta.num_tokens]
            if not lengths:
                del self._lengths[namespace]
        return True

    def segment_lengths(self, namespace: str, most: int) -> tuple[int, ...]:
        """The `most` commonest segment lengths indexed in `namespace`, commonest first;
        if it holds none, those of every namespace (how workers here chunk their KV)."""
        lengths = self._lengths.get(namespace)
        if lengths is None:
            lengths = sum(self._lengths.values(), Counter())
        return tuple(length for length, _ in lengths.most_common(most))

    def lookup_prefix(
        self, namespace: str, fingerprint: str, token_ids: Sequence[int]
    ) -> PrefixMatch:
        """Longest run of stored segments covering `token_ids` from position 0.

        Depth-first over verified children, longest child first: the first run
        found is the greedy one (longest child at each step); shorter children
        are then tried, within `max_search_nodes`, since a shorter child can
        lead to a longer run. Ties keep the run found first.
        """
        search = _PrefixSearch(self._children, namespace, fingerprint, tuple(token_ids))
        search.run(root_key(fingerprint), self.config.max_search_nodes)
        if not search.best_run:
            return _NO_MATCH
        return PrefixMatch(tuple(search.best_run), search.best_num_tokens)


class _PrefixSearch:
    """One depth-first search of `lookup_prefix`, iterative (runs can be deep)."""

    def __init__(
        self,
        children: dict[_ChildKey, dict[int, list[SegmentMeta]]],
        namespace: str,
        fingerprint: str,
        token_ids: tuple[int, ...],
    ) -> None:
        self._children = children
        self._namespace = namespace
        self._fingerprint = fingerprint
        self._token_ids = token_ids
        self.best_run: list[SegmentMeta] = []
        self.best_num_tokens = 0

    def run(self, root: bytes, max_nodes: int) -> None:
        """Explore runs from `root`. The first (greedy) run is free; after it,
        at most `max_nodes` more segments are visited."""
        # NOTE: positions grow along a path, so the best run ends where a path
        # stops: record only there (no copy of the run per step).
        run: list[SegmentMeta] = []
        frames = [(iter(self._verified_children(root, 0)), 0)]  # (children, position)
        greedy, budget = True, max_nodes
        while frames:
            children, position = frames[-1]
            if position == len(self._token_ids):  # the whole prompt is covered
                self._record(run, position)
                return
            meta = next(children, None)
            if meta is None:  # dead end: backtrack
                self._record(run, position)
                frames.pop()
                if run:
                    run.pop()
                greedy = False  # the first dead end completes the greedy run
                continue
            if not greedy:
                if budget == 0:
                    self._record(run, position)
                    return
                budget -= 1
            run.append(meta)
            end = position + meta.num_tokens
            frames.append((iter(self._verified_children(meta.context_key, end)), end))

    def _record(self, run: list[SegmentMeta], num_tokens: int) -> None:
        if num_tokens > self.best_num_tokens:
            self.best_run, self.best_num_tokens = list(run), num_tokens

    def _verified_children(self, parent_key: bytes, position: int) -> list[SegmentMeta]:
        """Children of `parent_key` whose token ids equal the prompt at `position`
        and whose context key is the chained hash of exactly those ids."""
        tokens = self._token_ids
        if position >= len(tokens):
            return []
        by_first = self._children.get((self._namespace, parent_key))
        if by_first is None:
            return []
        verified = []
        for meta in by_first.get(tokens[position], ()):
            span = tokens[position : position + meta.num_tokens]
            if span != meta.token_ids or meta.model_fingerprint != self._fingerprint:
                continue
            if context_key(parent_key, span) != meta.context_key:
                logger.warning("segment %s: context key does not chain; skipped", meta.segment_id)
                continue
            verified.append(meta)
        return verified
