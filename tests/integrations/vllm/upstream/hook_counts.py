"""How often each of kvsplice's connector hooks ran in one test, per role.

`HookCounts.install` wraps `KvspliceConnector`'s hooks for the test; calls made while
`paused` (another engine storing a prefix) are not counted. `missing` names the required
hooks that never ran. Knows the connector's hook names, not vLLM's tests.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvsplice.integrations.vllm import KvspliceConnector

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_HOOKS = (
    "register_kv_caches",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


class HookCounts:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._paused = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("__init__", *SCHEDULER_HOOKS, *WORKER_HOOKS):
            original = getattr(KvspliceConnector, name)  # a renamed hook fails here
            monkeypatch.setattr(KvspliceConnector, name, self._counting(name, original))

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def missing(self, required: tuple[str, ...]) -> list[str]:
        return [name for name in required if self.counts[name] == 0]

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(connector: KvspliceConnector, *args: Any, **kwargs: Any) -> Any:
            if not self._paused:
                self.counts[name if name != "__init__" else f"__init__({_role(args, kwargs)})"] += 1
            return original(connector, *args, **kwargs)

        return counted


def _role(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The role `KvspliceConnector(vllm_config, role, ...)` was made for."""
    return str(kwargs["role"].name if "role" in kwargs else args[1].name).lower()
