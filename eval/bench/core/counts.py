"""What one reuse call does, counted rather than timed: the guard of `bench core`.

Round trips to the sidecar by gRPC method (the sidecar's own `kvsplice_rpc_duration_seconds`
counts, read from its admin `/metrics` before and after the call), the model's decoder
forwards (a forward pre-hook), and segment reads by where they were served: a read in place
copies no payload bytes, a read over gRPC assembles one copy. Wall time is not here: a count
holds on a loaded machine, so `make test` can check it and fail when a round trip, a forward
or a copy is added. `allocated_bytes`, what torch's allocator handed out meanwhile (its
profiler's memory records), is deterministic where page faults are not (glibc reuses freed
memory or maps it afresh by its own thresholds). Only answers with status OK count; `ReportReuse` is left out: the store client sends it from a background
flush on its own clock, never on the call's path.
"""

from __future__ import annotations

import resource
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel

RPC_COUNT_FAMILY = "kvsplice_rpc_duration_seconds"
OFF_THE_CALL_PATH = frozenset({"ReportReuse"})


@dataclass(frozen=True)
class CallCounts:
    """One call's work: `rpcs` by method (only those it made), decoder `forwards`, its
    segment reads `reads_in_place` (no payload copy) and `reads_grpc` (one copy each), and
    the process's minor `page_faults` meanwhile (fresh pages: the allocator's, not the
    call's logic; not compared, as other threads of the process add a few), and the bytes
    torch allocated on the call's path, `allocated_bytes` (not compared: bounded instead)."""

    rpcs: dict[str, int]
    forwards: int
    reads_in_place: int
    reads_grpc: int
    page_faults: int = field(default=0, compare=False)
    allocated_bytes: int = field(default=0, compare=False)

    @property
    def payload_copies(self) -> int:
        return self.reads_grpc

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"payload_copies": self.payload_copies}


def sidecar_rpc_counts(admin_url: str) -> Counter[str]:
    """RPCs the sidecar has answered OK so far, by method, from its admin `/metrics` (a
    retry after a deadline is the fault path, not the call's own work)."""
    response = httpx.get(f"{admin_url}/metrics", timeout=10.0)
    response.raise_for_status()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(response.text):
        if family.name != RPC_COUNT_FAMILY:
            continue
        for sample in family.samples:
            if sample.name == f"{RPC_COUNT_FAMILY}_count" and sample.labels["code"] == "OK":
                counts[sample.labels["method"]] += int(sample.value)
    return counts


def count_call(
    call: Callable[[], object],
    model: PreTrainedModel,
    admin_url: str,
    reads_in_place: Callable[[], int],
) -> CallCounts:
    """Run `call` once and count what it did, then once more under torch's profiler for its
    `allocated_bytes`. `reads_in_place()`: the store client's reads in place so far; a read
    over gRPC is a `GetSegment` round trip."""
    decoder = model.get_decoder()
    forwards = 0

    def count_forward(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    rpcs_before, in_place_before = sidecar_rpc_counts(admin_url), reads_in_place()
    hook = decoder.register_forward_pre_hook(count_forward)
    faults_before = minor_page_faults()
    try:
        call()
    finally:
        faults = minor_page_faults() - faults_before
        hook.remove()
    rpcs = sidecar_rpc_counts(admin_url) - rpcs_before
    made = {m: n for m, n in sorted(rpcs.items()) if m not in OFF_THE_CALL_PATH}
    in_place = reads_in_place() - in_place_before
    allocated = torch_allocated_bytes(call)  # another call: the profiler slows the one timed
    return CallCounts(made, forwards, in_place, made.get("GetSegment", 0), faults, allocated)


def torch_allocated_bytes(call: Callable[[], object]) -> int:
    """Bytes torch's CPU allocator handed out while `call` ran (frees not subtracted).

    NOTE: read off the profiler's raw event tree (as `torch.profiler._memory_profiler`
    does), not `profile.events()`, whose Python post-processing takes ~1 s per forward.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    assert profiler.profiler is not None and profiler.profiler.kineto_results is not None
    total, stack = 0, list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
            total += event.extra_fields.alloc_size
    return total


def minor_page_faults() -> int:
    """This process's minor page faults so far (pages the kernel mapped in and zeroed)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
