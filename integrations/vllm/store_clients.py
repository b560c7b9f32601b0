"""One `StoreClient` per namespace a connector uses (a request's `cache_salt` makes its own).

Shared by the scheduler and worker sides of one process; thread-safe, bounded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvsplice.client.store.store_client import StoreClient
from kvsplice.client.store.store_config import ClientTls, StoreClientConfig
from kvsplice.integrations.vllm.connector_config import ConnectorConfig

MAX_CLIENTS = 64


class StoreClients:
    """StoreClients by namespace, least recently used closed past `MAX_CLIENTS`."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self._client_config = StoreClientConfig(
            lookup_timeout_s=config.lookup_timeout_ms / 1000,
            same_host_reads=config.same_host_reads,
        )
        self._tls = None if config.tls_ca is None else ClientTls(ca_path=config.tls_ca)
        self._clients: OrderedDict[str, StoreClient] = OrderedDict()
        self._lock = threading.Lock()

    def for_namespace(self, namespace: str) -> StoreClient:
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                client = StoreClient(
                    self.config.target, namespace, token=self.config.token,
                    config=self._client_config, tls=self._tls,
                )  # fmt: skip
                self._clients[namespace] = client
                if len(self._clients) > MAX_CLIENTS:
                    self._clients.popitem(last=False)[1].close()
            self._clients.move_to_end(namespace)
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
