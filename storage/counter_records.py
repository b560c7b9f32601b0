"""Counters kept with the tiers: one small record per namespace in the durable tier, so what
the sidecar counted survives a restart on the same LMDB environment.

Owns their key space (`keyspace.counters_key`) and encoding (JSON, counter name -> count);
what the counts mean belongs to the server (`server.reported_reuse`). The records are
never cached in a faster tier, never shared with other sidecars, never listed as segments.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping

from kvsplice.common.errors import CorruptPayload
from kvsplice.storage.keyspace import COUNTER_SPACE, counters_key, counters_namespace
from kvsplice.storage.tier import StorageTier

logger = logging.getLogger(__name__)

Counts = Mapping[str, int]
# (key, body) -> None: a durable put that makes room as a blob's does (`RoomMaker`).
WriteDurable = Callable[[bytes, bytes], None]
_VERSION = 1


def encode_counts(counts: Counts) -> bytes:
    return json.dumps({"version": _VERSION, "counts": dict(counts)}, sort_keys=True).encode()


def decode_counts(body: bytes | memoryview) -> dict[str, int]:
    """The counts in `body`; CorruptPayload if it is not a counters record of this version."""
    try:
        record = json.loads(bytes(body))
        counts = record["counts"] if record.get("version") == _VERSION else None
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise CorruptPayload(f"counters record does not decode: {error}") from error
    if not isinstance(counts, dict) or not all(
        isinstance(name, str) and type(n) is int and n >= 0 for name, n in counts.items()
    ):
        raise CorruptPayload(f"counters record holds no counts of version {_VERSION}")
    return counts


class CounterRecords:
    """Each namespace's counts in `durable` (the last tier), written through `write`."""

    def __init__(self, durable: StorageTier, write: WriteDurable) -> None:
        self._durable = durable
        self._write = write
        self._lock = threading.Lock()  # NOTE: one save at a time: a later one never lands first

    def load(self) -> dict[str, dict[str, int]]:
        """Every namespace's stored counts; a record that does not decode is skipped (logged)."""
        loaded: dict[str, dict[str, int]] = {}
        for key in self._durable.keys(COUNTER_SPACE):
            body = self._durable.get(key)
            if body is None:
                continue
            try:
                loaded[counters_namespace(key)] = decode_counts(body)
            except (CorruptPayload, UnicodeDecodeError) as error:
                logger.warning("%s: counters %r skipped: %s", self._durable.name, key, error)
        return loaded

    def save(self, counts_by_namespace: Mapping[str, Counts]) -> None:
        """Replace each named namespace's counts (one small put each)."""
        with self._lock:
            for namespace, counts in counts_by_namespace.items():
                self._write(counters_key(namespace), encode_counts(counts))
