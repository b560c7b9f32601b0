"""The worker's news for the scheduler, and the blocks a load fault taints until it is heard of."""

from __future__ import annotations

from helpers.vllm_worker import save_spec

from kvsplice.integrations.vllm.transfer_specs import LoadFaultNews
from kvsplice.integrations.vllm.worker_news import WorkerNewsDesk


def test_put_outcomes_are_told_once_and_counted() -> None:
    desk = WorkerNewsDesk()
    stored, lost = save_spec("r", 0, (0,)), save_spec("r", 1, (0, 1))
    desk.put_outcome(stored, True)
    desk.put_outcome(lost, False)
    news = desk.take(0)
    assert news.acked == [(stored.namespace, stored.key)] and news.failed == [
        (lost.namespace, lost.key)
    ]
    assert (desk.num_stored_chunks, desk.num_failed_saves) == (1, 1)
    assert not desk.take(0)


def test_a_fault_taints_its_blocks_until_the_scheduler_has_heard_of_it() -> None:
    desk = WorkerNewsDesk()
    over_block_1 = save_spec("r", 1, (0, 1))  # computed over blocks 0 and 1
    assert not desk.computed_over_a_fault(over_block_1, 0)
    desk.load_failed(LoadFaultNews("r", "ns", 4), {1})
    assert desk.computed_over_a_fault(over_block_1, 0)
    assert not desk.computed_over_a_fault(save_spec("o", 0, (2,)), 0)  # other blocks
    assert [f.position for f in desk.take(0).faults] == [4]
    assert desk.computed_over_a_fault(over_block_1, 0)  # not heard of yet
    desk.take(1)  # the scheduler absorbed the first fault
    assert not desk.computed_over_a_fault(over_block_1, 1)
