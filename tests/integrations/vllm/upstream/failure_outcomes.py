"""What kvsplice itself must show after one of vLLM's failure tests, and its broken variant.

`check_outcomes`: kvsplice agreed with the test's script (`KvspliceBehind.disagreements`);
a corrupt piece is gone from the sidecar; a new request for the same tokens is promised
only what is still good (nothing from the failed piece on); no chunk the failed step
computed over an unwritten block reached the sidecar. `disable_taint`: kvsplice's load
errors never reach vLLM and saves over them are not withheld (the negative control).
"""

from __future__ import annotations

from typing import Any

import pytest
from connector_stand_in import settled
from kvsplice_behind import KvspliceBehind
from load_faults import LoadFaults
from prefix_producer import PrefixProducer

from kvsplice.integrations.vllm import KvspliceConnector
from kvsplice.integrations.vllm.worker_news import WorkerNewsDesk


def check_outcomes(
    behind: list[KvspliceBehind], faults: LoadFaults | None, producer: PrefixProducer
) -> dict[str, Any]:
    disagreements = sorted({d for each in behind for d in each.disagreements})
    assert not disagreements, f"kvsplice and vLLM's script disagree: {disagreements}"
    if faults is None:
        return {}
    assert faults.injected, f"the test scripted no load failure for its {faults.kind} fault"
    promised = {}
    for injected in faults.injected:
        each = next(b for b in behind if injected.request_id in b.loads)
        load = each.loads[injected.request_id]
        if injected.kind == "corrupt":
            assert not faults.is_stored(injected.namespace, injected.segment_id), (
                f"kvsplice left the corrupt piece {injected.segment_id} in the sidecar"
            )
        good = (
            0
            if injected.kind == "killed"
            else load.start + injected.index * each.worker.side.paged.block_size
        )
        promised[injected.request_id] = _promised_again(each, producer, load)
        assert promised[injected.request_id] == good, (
            f"after the {injected.kind} piece {injected.index}, kvsplice promises "
            f"{promised[injected.request_id]} tokens of {injected.request_id}'s prefix, not {good}"
        )
    saves = [s for each in behind for s in each.failed_step_saves]
    for each in behind:
        assert each.worker.side.putter.flush(), "the puts did not end"
    stored = [s.key.hex() for s in saves if faults.is_stored(s.namespace, s.key.hex())]
    assert not stored, f"chunks computed over unwritten blocks were stored: {stored}"
    return {
        "injected": [f"{i.kind}@{i.index}:{i.request_id}" for i in faults.injected],
        "promised_again": promised,
        "failed_step_saves": len(saves),
        "withheld_saves": sum(b.worker.side.num_withheld_saves for b in behind),
        "failed_loads": sum(b.worker.side.num_failed_loads for b in behind),
    }


def _promised_again(each: KvspliceBehind, producer: PrefixProducer, load: Any) -> int:
    """What kvsplice's lookup promises a new request for the failed load's tokens."""
    block_size = each.worker.side.paged.block_size
    request = producer.request([*load.token_ids[: load.end], 0], block_size)
    num_tokens, _ = settled(each.kvsplice.get_num_new_matched_tokens, request, 0)
    return int(num_tokens or 0)


def disable_taint(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvsplice broken on purpose: its load errors never reach vLLM, and chunks computed
    over blocks that failed to load are saved."""
    report = KvspliceConnector.get_block_ids_with_load_errors

    def no_load_errors(connector: KvspliceConnector) -> set[int]:
        report(connector)  # taken, and dropped
        return set()

    monkeypatch.setattr(KvspliceConnector, "get_block_ids_with_load_errors", no_load_errors)
    monkeypatch.setattr(WorkerNewsDesk, "computed_over_a_fault", lambda *args: False)
