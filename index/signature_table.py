"""Signatures of one LSH group as rows of one uint32 matrix.

Ranking many LSH candidates then costs one fancy-index and one compare in
numpy instead of a Python loop over MinHash objects. It knows nothing about
LSH buckets or segment metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INITIAL_ROWS = 64


class SignatureTable:
    """MinHash hash values by key; removed rows are reused."""

    def __init__(self, num_perm: int) -> None:
        self._rows = np.empty((_INITIAL_ROWS, num_perm), dtype=np.uint32)
        self._row_by_key: dict[bytes, int] = {}
        self._free_rows: list[int] = []
        self._num_rows_used = 0

    def __len__(self) -> int:
        return len(self._row_by_key)

    def put(self, key: bytes, hashvalues: np.ndarray) -> None:
        """Store (or overwrite) the hash values of `key`; `hashvalues: [num_perm]`."""
        row = self._row_by_key.get(key)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else self._new_row()
            self._row_by_key[key] = row
        self._rows[row] = hashvalues

    def remove(self, key: bytes) -> bool:
        row = self._row_by_key.pop(key, None)
        if row is None:
            return False
        self._free_rows.append(row)
        return True

    def jaccard(self, keys: Sequence[bytes], hashvalues: np.ndarray) -> np.ndarray:
        """Estimated Jaccard of each key's signature with `hashvalues` (as
        `MinHash.jaccard`: the fraction of equal hash values); `[len(keys)]`."""
        rows = np.fromiter((self._row_by_key[k] for k in keys), dtype=np.intp, count=len(keys))
        num_equal = np.count_nonzero(self._rows[rows] == hashvalues, axis=1)
        return num_equal / self._rows.shape[1]

    def _new_row(self) -> int:
        if self._num_rows_used == len(self._rows):
            grown = np.empty((2 * len(self._rows), self._rows.shape[1]), dtype=np.uint32)
            grown[: len(self._rows)] = self._rows
            self._rows = grown
        self._num_rows_used += 1
        return self._num_rows_used - 1
