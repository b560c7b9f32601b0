"""Who the store tells about segments that went, segments other sidecars put, and blobs
other sidecars changed. Owns the listener lists and the calling rule; not what they do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvsplice.common.segment import SegmentMeta

logger = logging.getLogger(__name__)

RemovalListener = Callable[[SegmentMeta], None]
ArrivalListener = Callable[[SegmentMeta], None]
BlobListener = Callable[[str, str], None]  # (namespace, blob name) changed elsewhere


class StoreListeners:
    """Thread-safe lists of listeners. Callers hold none of the store's locks while notifying."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._removal: list[RemovalListener] = []
        self._arrival: list[ArrivalListener] = []
        self._blob: list[BlobListener] = []

    def add_removal(self, listener: RemovalListener) -> None:
        with self._lock:
            self._removal.append(listener)

    def add_arrival(self, listener: ArrivalListener) -> None:
        with self._lock:
            self._arrival.append(listener)

    def add_blob(self, listener: BlobListener) -> None:
        with self._lock:
            self._blob.append(listener)

    def removed(self, metas: Sequence[SegmentMeta]) -> None:
        """Tell every removal listener; a listener's error is re-raised after all ran."""
        with self._lock:
            listeners = list(self._removal)
        errors = []
        for meta in metas:
            for listener in listeners:
                try:
                    listener(meta)
                except Exception as exc:
                    logger.exception("removal listener failed on %s", meta.segment_id)
                    errors.append(exc)
        if errors:
            raise errors[0]

    def arrived(self, metas: Sequence[SegmentMeta], blobs: Sequence[tuple[str, str]]) -> None:
        """Tell arrival listeners of `metas` and blob listeners of `blobs` (namespace, name)."""
        with self._lock:
            arrival, blob = list(self._arrival), list(self._blob)
        for meta in metas:
            for listener in arrival:
                listener(meta)
        for namespace, name in blobs:
            for blob_listener in blob:
                blob_listener(namespace, name)
