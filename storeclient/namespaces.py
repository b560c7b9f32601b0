"""Store clients by namespace over one channel: one client per namespace, bounded.

Requests may each name a namespace of their own (vLLM's `cache_salt` makes one); every
namespace's client shares the first client's channel, token, TLS and receive buffers
(`StoreClient.in_namespace`), so namespaces cost no connections. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvsplice.storeclient.client import StoreClient

MAX_CLIENTS = 64


class NamespaceClients:
    """StoreClients by namespace, the least recently used closed past `max_clients`."""

    def __init__(self, base: StoreClient, max_clients: int = MAX_CLIENTS) -> None:
        self._base = base
        self._max_clients = max_clients
        self._clients: OrderedDict[str, StoreClient] = OrderedDict()
        self._lock = threading.Lock()

    def for_namespace(self, namespace: str) -> StoreClient:
        if namespace == self._base.namespace:
            return self._base
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                client = self._base.in_namespace(namespace)
                self._clients[namespace] = client
                if len(self._clients) > self._max_clients:
                    self._clients.popitem(last=False)[1].close()
            self._clients.move_to_end(namespace)
            return client

    def close(self) -> None:
        """Close every namespace's client, then the first (whose channel they share)."""
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        self._base.close()
