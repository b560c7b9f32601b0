"""The store clients of one connector: one channel to the sidecar, a client per namespace.

A request's `cache_salt` makes its own namespace; every namespace's client shares the
configured namespace's channel, token, TLS and receive buffers (`StoreClient.in_namespace`),
so salts cost no connections. Shared by the scheduler and worker sides; thread-safe, bounded.
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
            staged_puts=config.staged_puts,
        )
        self._token = config.resolved_token()
        self._tls = None
        if config.tls_ca is not None or config.tls_cert is not None:
            self._tls = ClientTls(
                ca_path=config.tls_ca, cert_path=config.tls_cert, key_path=config.tls_key
            )
        self._base = StoreClient(
            config.target, config.namespace, token=self._token,
            config=self._client_config, tls=self._tls,
        )  # fmt: skip
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
                if len(self._clients) > MAX_CLIENTS:
                    self._clients.popitem(last=False)[1].close()
            self._clients.move_to_end(namespace)
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        self._base.close()
