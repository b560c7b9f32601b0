"""PutQueue, the background putters' shape: in order on one thread, bounded, flushed, closed."""

from __future__ import annotations

import threading

from kvsplice.storeclient.put_queue import PutQueue


def test_items_are_handled_in_order_and_close_drains_the_queue() -> None:
    handled: list[int] = []
    puts: PutQueue[int] = PutQueue(handled.append, max_pending=4, name="test-putter")
    for item in range(10):
        puts.put(item)  # blocks while four wait: back-pressure, nothing dropped
    puts.close()
    assert handled == list(range(10)) and not puts.running
    puts.close()  # idempotent


def test_offer_refuses_when_full_and_flush_waits_for_what_was_queued() -> None:
    gate, handled = threading.Event(), []

    def handle(item: int) -> None:
        gate.wait()
        handled.append(item)

    puts: PutQueue[int] = PutQueue(handle, max_pending=1, name="test-putter")
    assert puts.offer(1)
    while not puts.offer(2):  # the thread takes 1 and blocks on it; 2 then fills the queue
        pass
    assert not puts.offer(3)  # full: the owner drops it
    assert not puts.flush(timeout_s=0.05)  # 1 and 2 are not handled yet
    gate.set()
    assert puts.flush(timeout_s=10.0) and handled == [1, 2]
    puts.close(timeout_s=10.0)
    assert not puts.running
