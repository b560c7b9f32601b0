"""What one engine call does, counted rather than timed: round trips, forwards, K/V copies.

Owns `count_call` and `CallCounts`: the store client's RPCs by method (its channel's
counter, every attempt), the model's forwards (passes through the first decoder layer) and
the tokens they carried, and the bytes torch ops wrote (every output and in-place
target). Counts do not depend on how busy the machine is, so a test can pin them; it
times nothing, and its hooks slow the counted call (never count a timed one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvsplice.client.reuse_engine import ReuseEngine
from kvsplice.client.store.rpc_counter import rpcs_between

T = TypeVar("T")


@dataclass(frozen=True)
class CallCounts:
    """`rpcs`: store-client RPCs by method ("LookupPrefix": 1, ...). `num_forwards`: passes
    through the model's first decoder layer; `num_forwarded_tokens`: the tokens they carried.
    `torch_written_nbytes`: bytes written by torch ops (a K/V clone, a cache concatenated
    with its new tokens, a dtype cast all count; numba's fused splice writes outside torch)."""

    rpcs: dict[str, int] = field(default_factory=dict)
    num_forwards: int = 0
    num_forwarded_tokens: int = 0
    torch_written_nbytes: int = 0

    @property
    def num_rpcs(self) -> int:
        return sum(self.rpcs.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rpcs": dict(self.rpcs),
            "num_rpcs": self.num_rpcs,
            "num_forwards": self.num_forwards,
            "num_forwarded_tokens": self.num_forwarded_tokens,
            "torch_written_nbytes": self.torch_written_nbytes,
        }


def count_call(engine: ReuseEngine, call: Callable[[], T]) -> tuple[T, CallCounts]:
    """Run `call` (one of `engine`'s calls) and count what it did on `engine`'s model and store."""
    rpcs_before = {} if engine.store is None else engine.store.rpcs
    writes = _WrittenBytes()
    with _forwards(_first_layer(engine)) as forwards, writes:
        result = call()
    rpcs = {} if engine.store is None else rpcs_between(rpcs_before, engine.store.rpcs)
    counts = CallCounts(rpcs, forwards[0], forwards[1], writes.nbytes)
    return result, counts


def _first_layer(engine: ReuseEngine) -> torch.nn.Module:
    layers = engine.loaded.model.get_decoder().layers
    return layers[0]  # type: ignore[no-any-return]


@contextmanager
def _forwards(layer: torch.nn.Module) -> Iterator[list[int]]:
    """[passes, tokens] through `layer` while the context is open."""
    counted = [0, 0]

    def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        counted[0] += 1
        counted[1] += int(hidden.shape[-2])  # hidden: [B, T, hidden]

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield counted
    finally:
        handle.remove()


class _WrittenBytes(TorchDispatchMode):
    """Sums the bytes of every tensor a torch op returns (in-place ops return their target)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _is_view(func) and func._schema.name not in _ALLOCATIONS:
            self.nbytes += sum(
                t.numel() * t.element_size()
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor)
            )
        return out


# Ops that allocate without writing (`torch.empty`): the writes into them count themselves.
_ALLOCATIONS = frozenset(
    {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
     "aten::new_empty_strided"}
)  # fmt: skip


def _is_view(func: Any) -> bool:
    """Ops that return a view of their input (slice, select, view, expand) write nothing."""
    schema = func._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
