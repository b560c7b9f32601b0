"""A real `KvspliceConnector` where vLLM's tests install `create_mock_connector()`'s Mock.

The stand-in is still a Mock (the tests script it and count its calls), but every hook
runs kvsplice's code. Where a test scripts a hook, kvsplice must agree with the
script: a scripted hit is first stored in the sidecar (by `seed`), then kvsplice's
own lookup must promise exactly it, sync or async (its `load_async`). Only vLLM's connector API is used.
Knows nothing of where the sidecar is or how a prefix gets stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from unittest.mock import Mock

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

# Hooks whose scripted answer kvsplice must give too (vLLM's tests script the only
# answer a prefix cache may give).
AGREEING_HOOKS = ("request_finished", "take_events")
LOOKUP_DEADLINE_S = 30.0

Reconcile = Callable[..., Any]
Seed = Callable[[list[int]], None]


class ConnectorHook(Mock):
    """One hook: kvsplice's code runs on every call; once a test scripts the hook
    (`side_effect`, `return_value`), `reconcile(real, scripted, *args)` answers."""

    def __init__(self, real: Callable[..., Any], reconcile: Reconcile, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.__dict__["_real"] = real
        self.__dict__["_reconcile"] = reconcile
        self.__dict__["_scripted"] = False

    def _get_child_mock(self, **kwargs: Any) -> Mock:
        return Mock(**kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("side_effect", "return_value"):
            self.__dict__["_scripted"] = True
        super().__setattr__(name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        answer = super().__call__(*args, **kwargs)  # counts the call, runs the script
        if not self.__dict__["_scripted"]:
            return self.__dict__["_real"](*args, **kwargs)
        return self.__dict__["_reconcile"](self.__dict__["_real"], answer, *args, **kwargs)


def stand_in(connector: KVConnectorBase_V1, seed: Seed) -> Mock:
    """A Mock over `connector` (scheduler role) that vLLM's tests can script and count."""
    mock = Mock(wraps=connector)
    for name in _property_names(connector):  # a Mock's attribute would be truthy
        setattr(mock, name, getattr(connector, name))
    mock.get_num_new_matched_tokens = ConnectorHook(
        connector.get_num_new_matched_tokens, _matched_tokens_reconciler(seed)
    )
    for name in AGREEING_HOOKS:
        setattr(mock, name, ConnectorHook(getattr(connector, name), _agree(name)))
    return mock


def _matched_tokens_reconciler(seed: Seed) -> Reconcile:
    def reconcile(
        real: Callable[..., tuple[int | None, bool]],
        scripted: tuple[int, bool],
        request: Any,
        num_computed_tokens: int,
    ) -> tuple[int, bool]:
        num_tokens, _ = scripted
        num_held = num_computed_tokens + num_tokens
        if num_tokens:
            seed(list(request.all_token_ids[: num_held + 1]))  # the +1 is computed, not held
        answer = settled(real, request, num_computed_tokens)
        assert answer == scripted, (
            f"kvsplice answered {answer} for request {request.request_id} "
            f"({request.num_prompt_tokens} prompt tokens, {num_computed_tokens} computed "
            f"locally, its first {num_held} stored in the sidecar); vLLM's test scripts {scripted}"
        )
        return answer

    return reconcile


def settled(
    real: Callable[..., tuple[int | None, bool]], request: Any, num_computed_tokens: int
) -> tuple[int | None, bool]:
    """kvsplice's answer once its lookup returned.

    NOTE: a connector may answer None ("ask me next step") while its lookup runs. vLLM's
    tests expect the hit in the step the request arrives, so the same step asks again.
    """
    deadline = time.monotonic() + LOOKUP_DEADLINE_S
    answer = real(request, num_computed_tokens)
    while answer[0] is None and time.monotonic() < deadline:
        time.sleep(0.005)
        answer = real(request, num_computed_tokens)
    return answer


def _agree(name: str) -> Reconcile:
    def reconcile(real: Callable[..., Any], scripted: Any, *args: Any, **kwargs: Any) -> Any:
        answer = real(*args, **kwargs)
        assert _comparable(answer) == _comparable(scripted), (
            f"kvsplice's {name} answered {answer!r}; vLLM's test scripts {scripted!r}"
        )
        return scripted

    return reconcile


def _comparable(answer: Any) -> Any:
    """Events are any iterable (vLLM's tests script `()`; a connector may yield a list)."""
    if isinstance(answer, Iterable) and not isinstance(answer, tuple):
        return tuple(answer)
    return answer


def _property_names(connector: KVConnectorBase_V1) -> list[str]:
    return [
        name
        for name in dir(type(connector))
        if isinstance(getattr(type(connector), name, None), property)
    ]
