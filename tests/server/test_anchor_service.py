"""AnchorService: pools over store blobs — eviction frees payloads, state survives a restart."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from helpers.store import FINGERPRINT, NAMESPACE, OTHER_FINGERPRINT, make_store

from kvsplice.common.errors import InvalidRequest, ResourceExhausted
from kvsplice.index.anchor_pool import AnchorPoolConfig
from kvsplice.server.anchor_service import POOLS_BLOB, AnchorService, AnchorWrite
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.storage.tiered_store import TieredStore


def make_anchors(
    store: TieredStore | None = None, capacity: int = 3, **limits: int
) -> AnchorService:
    return AnchorService(
        store or make_store(),
        AnchorPoolConfig(capacity=capacity, window=capacity),
        SegmentServiceConfig(**limits),
    )


def make_write(
    anchor_id: str,
    agents: Mapping[str, bytes] | None = None,
    *,
    placeholder_id: str = "question",
    base: bytes | None = None,
    fingerprint: str = FINGERPRINT,
) -> AnchorWrite:
    return AnchorWrite(
        namespace=NAMESPACE,
        model_fingerprint=fingerprint,
        placeholder_id=placeholder_id,
        anchor_id=anchor_id,
        base_payload=base if base is not None else f"base-{anchor_id}".encode(),
        agent_payloads=dict(
            agents if agents is not None else {"critic": f"off-{anchor_id}".encode()}
        ),
        num_tokens=12,
    )


def test_put_then_get_returns_payloads_in_insertion_order() -> None:
    anchors = make_anchors()
    assert anchors.put(make_write("a1")) == []
    assert anchors.put(make_write("a2", {"critic": b"c2", "judge": b"j2"})) == []
    records = anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=True)
    assert [r.anchor_id for r in records] == ["a1", "a2"]
    assert records[1].base_payload == b"base-a2"
    assert dict(records[1].agent_payloads) == {"critic": b"c2", "judge": b"j2"}
    assert records[0].created_seq < records[1].created_seq


def test_without_payloads_only_bookkeeping_is_returned() -> None:
    anchors = make_anchors()
    anchors.put(make_write("a1"))
    (record,) = anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=False)
    assert (record.base_payload, dict(record.agent_payloads), record.num_tokens) == (b"", {}, 12)


def test_get_filters_by_anchor_ids_and_agent() -> None:
    anchors = make_anchors()
    anchors.put(make_write("a1", {"critic": b"c1", "judge": b"j1"}))
    anchors.put(make_write("a2", {"critic": b"c2"}))
    listed = anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=False)
    assert [r.agent_ids for r in listed] == [("critic", "judge"), ("critic",)]
    (record,) = anchors.get(
        NAMESPACE, FINGERPRINT, "question", True, anchor_ids=("a1",), agent_id="judge"
    )
    assert (record.anchor_id, dict(record.agent_payloads)) == ("a1", {"judge": b"j1"})
    assert record.agent_ids == ("critic", "judge")  # listed even when not sent
    assert anchors.get(NAMESPACE, FINGERPRINT, "question", True, anchor_ids=("zz",)) == []
    with pytest.raises(InvalidRequest):
        anchors.get(NAMESPACE, FINGERPRINT, "question", True, anchor_ids=("a/b",))


def test_an_answer_over_one_anchors_worth_of_payloads_is_refused() -> None:
    """A pool of anchors near the size cap must not be sent as one oversize message."""
    anchors = make_anchors(max_anchor_nbytes=1000)
    anchors.put(make_write("a1", {"critic": b"c" * 400}, base=b"b" * 400))
    anchors.put(make_write("a2", {"critic": b"c" * 400}, base=b"b" * 400))
    with pytest.raises(ResourceExhausted, match="fewer anchor_ids"):
        anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=True)
    for anchor_id in ("a1", "a2"):  # one by one each fits
        (record,) = anchors.get(NAMESPACE, FINGERPRINT, "question", True, anchor_ids=(anchor_id,))
        assert len(record.base_payload) == 400
    assert len(anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=False)) == 2


def test_a_full_pool_evicts_and_deletes_the_victims_blobs() -> None:
    store = make_store()
    anchors = make_anchors(store, capacity=2)
    anchors.put(make_write("a1"))
    anchors.put(make_write("a2"))
    anchors.touch(NAMESPACE, FINGERPRINT, "question", ["a1"])  # a2 becomes least used
    assert anchors.put(make_write("a3")) == ["a2"]
    ids = [r.anchor_id for r in anchors.get(NAMESPACE, FINGERPRINT, "question", True)]
    assert ids == ["a1", "a3"]
    names = set(store.iter_blob_names(NAMESPACE, "anchors/"))
    assert not any("/a2/" in name for name in names)
    assert POOLS_BLOB in names


def test_touch_counts_only_pooled_ids() -> None:
    anchors = make_anchors()
    anchors.put(make_write("a1"))
    assert anchors.touch(NAMESPACE, FINGERPRINT, "question", ["a1", "gone"]) == 1
    assert anchors.touch(NAMESPACE, FINGERPRINT, "other-placeholder", ["a1"]) == 0
    (record,) = anchors.get(NAMESPACE, FINGERPRINT, "question", False)
    assert record.activation_count == 1


def test_pools_are_scoped_by_fingerprint() -> None:
    anchors = make_anchors()
    anchors.put(make_write("a1"))
    assert anchors.get(NAMESPACE, OTHER_FINGERPRINT, "question", True) == []


def test_a_second_put_adds_agents_and_keeps_the_base_and_counts() -> None:
    """Each agent puts its own offsets; the base they were taken against never changes."""
    store = make_store()
    anchors = make_anchors(store)
    anchors.put(make_write("a1", {"critic": b"c", "judge": b"j"}))
    anchors.touch(NAMESPACE, FINGERPRINT, "question", ["a1"])
    assert anchors.put(make_write("a1", {"judge": b"j2", "coder": b"k"}, base=b"new")) == []
    (record,) = anchors.get(NAMESPACE, FINGERPRINT, "question", True)
    assert record.base_payload == b"base-a1"
    assert dict(record.agent_payloads) == {"critic": b"c", "judge": b"j2", "coder": b"k"}
    assert (record.activation_count, record.created_seq) == (1, 0)


def test_pool_state_and_payloads_survive_a_restart(tmp_path) -> None:
    store = make_store(str(tmp_path))
    anchors = make_anchors(store)
    anchors.put(make_write("a1"))
    anchors.touch(NAMESPACE, FINGERPRINT, "question", ["a1"])
    store.close()
    reopened = make_anchors(make_store(str(tmp_path)))
    (record,) = reopened.get(NAMESPACE, FINGERPRINT, "question", True)
    assert (record.anchor_id, record.activation_count, record.base_payload) == ("a1", 1, b"base-a1")


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (make_write("a/1"), "anchor_id"),
        (make_write("a1", placeholder_id=""), "placeholder_id"),
        (make_write("a1", {"bad agent": b"x"}), "agent_id"),
        (make_write("a1", base=b""), "base_payload"),
        (make_write("a1", fingerprint="nope"), "fingerprint"),
        (make_write("a1", base=b"x" * 2048), "bytes"),
    ],
)
def test_bad_writes_are_invalid_requests(write: AnchorWrite, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        make_anchors(max_anchor_nbytes=1024).put(write)


def test_unreadable_pool_state_starts_empty_instead_of_failing() -> None:
    store = make_store()
    store.put_blob(NAMESPACE, POOLS_BLOB, b"not json")
    anchors = make_anchors(store)
    assert anchors.get(NAMESPACE, FINGERPRINT, "question", True) == []
    assert anchors.put(make_write("a1")) == []


def blob(anchor_id: str, agent: str | None = None) -> str:
    base = f"anchors/{FINGERPRINT}/question/{anchor_id}"
    return f"{base}/base" if agent is None else f"{base}/agent/{agent}"


def listed(anchors: AnchorService) -> dict[str, tuple[str, ...]]:
    return {
        r.anchor_id: r.agent_ids
        for r in anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=False)
    }


def test_an_anchor_whose_store_evicted_its_base_leaves_the_pool() -> None:
    store = make_store()
    anchors = make_anchors(store)
    anchors.put(make_write("a1", {"critic": b"c1", "judge": b"j1"}))
    anchors.put(make_write("a2"))
    store.delete_blob(NAMESPACE, blob("a1"))
    records = anchors.get(NAMESPACE, FINGERPRINT, "question", include_payloads=True)
    assert [r.anchor_id for r in records] == ["a2"]
    assert listed(anchors) == {"a2": ("critic",)}  # not listed as usable any more
    assert store.get_blob(NAMESPACE, blob("a1", "judge")) is None  # its offsets freed
    assert make_anchors(store).get(NAMESPACE, FINGERPRINT, "question", False)[0].anchor_id == "a2"


def test_an_agent_whose_offsets_were_evicted_leaves_the_anchor_only() -> None:
    store = make_store()
    anchors = make_anchors(store)
    anchors.put(make_write("a1", {"critic": b"c1", "judge": b"j1"}))
    store.delete_blob(NAMESPACE, blob("a1", "judge"))
    assert anchors.get(NAMESPACE, FINGERPRINT, "question", True, agent_id="judge") == []
    assert listed(anchors) == {"a1": ("critic",)}
    (record,) = anchors.get(NAMESPACE, FINGERPRINT, "question", True, agent_id="critic")
    assert dict(record.agent_payloads) == {"critic": b"c1"}


def test_a_put_after_its_base_was_evicted_starts_a_new_incarnation() -> None:
    # The old agents' offsets were against the lost base: they must not be served
    # with the new one, and the new incarnation has a new creation number.
    store = make_store()
    anchors = make_anchors(store)
    anchors.put(make_write("a1", {"critic": b"c1"}))
    anchors.put(make_write("a2"))
    (old,) = [
        r for r in anchors.get(NAMESPACE, FINGERPRINT, "question", False) if r.anchor_id == "a1"
    ]
    store.delete_blob(NAMESPACE, blob("a1"))
    anchors.put(make_write("a1", {"judge": b"j1"}, base=b"new-base"))
    records = {r.anchor_id: r for r in anchors.get(NAMESPACE, FINGERPRINT, "question", True)}
    assert dict(records["a1"].agent_payloads) == {"judge": b"j1"}
    assert records["a1"].base_payload == b"new-base"
    assert records["a1"].created_seq > max(old.created_seq, records["a2"].created_seq)
    assert store.get_blob(NAMESPACE, blob("a1", "critic")) is None


def test_creation_numbers_are_never_handed_out_twice_even_across_a_restart() -> None:
    store = make_store()
    anchors = make_anchors(store)
    anchors.put(make_write("a1"))
    anchors.put(make_write("a2"))
    store.delete_blob(NAMESPACE, blob("a2"))
    anchors.get(NAMESPACE, FINGERPRINT, "question", True)  # forgets a2 (seq 1)
    restarted = make_anchors(store)
    restarted.put(make_write("a3"))
    seqs = {
        r.anchor_id: r.created_seq for r in restarted.get(NAMESPACE, FINGERPRINT, "question", False)
    }
    assert seqs == {"a1": 0, "a3": 2}
