"""Where held segments sit in their chains: which ones a later segment extends, which were
read again, and so which are *tails* nobody has come back for; and descendants before their
ancestors. Eviction's view of a session's segments beyond the lease (`sessions`).

A segment's identity is its whole left context (chained keys), so a prompt's segments form a
path from the root, and sessions sharing a prefix form a tree. A prefix lookup stops at the
first missing segment: evicting an ancestor makes every descendant unreachable though stored.
No I/O, no locks: `SessionLeases` calls it under the store's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class HeldChains:
    """The segments sessions held (while stored): their parents, which of them a later held
    segment extends (`_extended`), and which were read or held again since (`_reread`).

    A *tail* is a held segment neither extended nor read again: the end of the prompt that put
    it (an agent's own instruction, a question), which the workflow's later calls diverged
    before or have not reached yet. NOTE: a multi-turn chat's last full chunk is a tail until
    the next turn reads it; an agent pipeline's instructions stay tails for good.
    """

    def __init__(self) -> None:
        self._parent: dict[bytes, bytes] = {}
        self._children: dict[bytes, dict[bytes, None]] = {}  # ordered: replays repeat
        self._extended: set[bytes] = set()
        self._reread: set[bytes] = set()
        self._seq: dict[bytes, int] = {}  # the hold that first held each known key

    def held(self, key: bytes, parent: bytes | None, seq: int) -> None:
        """Hold number `seq` holds `key` (stored after `parent`): read again if known before."""
        if key in self._seq:
            self._reread.add(key)
        else:
            self._seq[key] = seq
        if parent is not None and key not in self._parent:
            self._parent[key] = parent
            self._children.setdefault(parent, {})[key] = None
            self._extended.add(parent)

    def read(self, key: bytes) -> None:
        """`key` was read (any request's fetch)."""
        if key in self._seq:
            self._reread.add(key)

    def is_tail(self, key: bytes, latest_seq: int) -> bool:
        """Neither extended nor read again though its session held more since (`latest_seq`:
        its holders' latest hold): the session went on without it."""
        return (
            key not in self._extended
            and key not in self._reread
            and self._seq.get(key, latest_seq) < latest_seq
        )

    def forget(self, key: bytes) -> None:
        """`key` left the store. Its parent stays extended (it was a prefix)."""
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.pop(key, None)
                if not siblings:
                    del self._children[parent]
        for child in self._children.pop(key, ()):
            self._parent.pop(child, None)
        self._extended.discard(key)
        self._reread.discard(key)
        self._seq.pop(key, None)

    def leaves_first(
        self, keys: Iterable[bytes], wanted: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        """`keys` in their order, each preceded by its descendants that `wanted` accepts,
        deepest first; every key at most once (an ancestor's eviction strands its subtree)."""
        done: set[bytes] = set()
        for key in keys:
            if key in done:
                continue
            stack = [(key, False)]
            while stack:
                node, expanded = stack.pop()
                if node in done:
                    continue
                if expanded:
                    done.add(node)
                    if node is key or wanted(node):
                        yield node
                    continue
                stack.append((node, True))
                stack.extend((child, False) for child in self._children.get(node, ()))
