"""The fault soak: distinct prompts over shared prefixes through two engines, with each fault
injected where kvsplice must observe it, and counted there (`vllm:kvsplice_*` on /metrics).

The requests: every prompt once (each engine stores half), then repeats on the other engine
(which loads what the first stored). The faults, each with probe requests the schedule
keeps away from the rest, so that the fault is certain to be met and its count known:
- the sidecar SIGKILLed (probes while it is down: failed lookups), then restarted;
- stored bytes flipped in one prompt's last link per engine (a probe on the engine that
  never computed that block loads it: corrupt loads == the links flipped, none left bad);
- segments deleted between lookup and load (engine a's traffic held, its KV blocks all taken
  by streamed requests, a probe looked up and left waiting for blocks, its links deleted,
  the streams closed so the blocks free: missing loads == 1);
- the sidecar SIGSTOPped (probes time out) and kept stopped until both engines counted failed
  lookups and a breaker trip.
"""

from __future__ import annotations

import mmap
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
from helpers.waiting import wait_for

from kvsplice.common.keys import chunk_links
from kvsplice.eval.bench.vllm.engine import Engine, Sidecar
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

BLOCK = 128  # vLLM's CPU block size, the connector's chunk in these tests
ENGINES = ("b", "a")  # request i of pass p goes to ENGINES[(i + p) % 2]
DELETE_ATTEMPTS = 3  # a delete step whose hogs finished before the deletes landed is redone
HOG_SLACK = 120  # a hog's prompt ends this many tokens before its last block's end
HOG_BLOCKS = 8  # blocks of one hog at most (1,024 tokens, under max_model_len)
STRIDE = 7  # repeats visit the prompts in this stride (coprime with an even count)


@dataclass(frozen=True)
class Schedule:
    """Request i's prompt and engine: pass 0 serves every prompt once, later passes repeat
    them in a stride on the other engine."""

    num_prompts: int
    num_requests: int

    def __post_init__(self) -> None:
        if self.num_prompts % 2 or self.num_prompts % STRIDE == 0:
            raise ValueError(f"num_prompts must be even and not a multiple of {STRIDE}")

    def prompt(self, i: int) -> int:
        return i if i < self.num_prompts else (i * STRIDE) % self.num_prompts

    def engine(self, i: int) -> str:
        return ENGINES[(i + i // self.num_prompts) % 2]

    def requests_of(self, k: int) -> list[int]:
        return [i for i in range(self.num_requests) if self.prompt(i) == k]


def soak_prompts(tokenizer: Any, bases: list[list[int]], num_prompts: int) -> list[list[int]]:
    """`num_prompts` distinct prompts: a shared base (each served by both engines' requests),
    then a tail of its own longer than a block (so each prompt's last full block is its own)."""
    prompts = []
    for j in range(num_prompts):
        text = f"\n\nCase {j}: " + " ".join(f"v{j}_{i} = {(i * j + 7) % 97}" for i in range(60))
        tail = tokenizer.encode(text, add_special_tokens=False)[: BLOCK + 2 + j % 41]
        prompts.append([*bases[(j // 2) % len(bases)], *tail])
    return prompts


def last_link(fingerprint: str, prompt: list[int]) -> bytes:
    """The key of the prompt's last block an engine may load (one token is left to compute)."""
    num_blocks = (len(prompt) - 1) // BLOCK
    return chunk_links(fingerprint, prompt, BLOCK)[num_blocks - 1].key


def stored_segment_ids(sidecar: Sidecar, namespace: str) -> list[str]:
    ids: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = httpx.get(
            f"{sidecar.admin_url}/v1/segments",
            params={"namespace": namespace, "offset": offset, "limit": 500},
            timeout=30.0,
        ).json()
        ids += [row["segment_id"] for row in page["segments"]]
        offset = page["next_offset"]
    return ids


def read_segment(sidecar: Sidecar, namespace: str, key: bytes | str) -> object | None:
    """The segment verified (over gRPC), None if it is absent or fails verification."""
    config = StoreClientConfig(same_host_reads=False)
    with StoreClient(sidecar.target, namespace, config=config) as client:
        return client.get_segment(key)


def corrupt_stored(sidecar: Sidecar, namespace: str, context_key: bytes) -> None:
    """Flip bytes of one stored payload where the sidecar keeps it (what same-host reads map):
    inside its LMDB file, or in the payload file a staged put was adopted as."""
    found = read_segment(sidecar, namespace, context_key)
    assert found is not None, "the chunk to corrupt is not stored"
    payload = bytes(found[1])  # type: ignore[index]
    window = payload[len(payload) // 2 : len(payload) // 2 + 64]
    files = [sidecar.data_dir / "data.mdb", *sorted((sidecar.data_dir / "payloads").glob("*"))]
    for path in files:
        if path.stat().st_size == 0:
            continue
        with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as data:
            offset = data.find(window)
            if offset >= 0:
                data[offset : offset + len(window)] = bytes(b ^ 0xFF for b in window)
                data.flush()
                return
    raise AssertionError("the payload is neither in the LMDB file nor in a payload file")


def delete_segment(sidecar: Sidecar, namespace: str, segment_id: str) -> bool:
    """Whether the sidecar held the segment (and deleted it)."""
    response = httpx.delete(
        f"{sidecar.admin_url}/v1/segments/{segment_id}", params={"namespace": namespace},
        timeout=10.0,
    )  # fmt: skip
    response.raise_for_status()
    return bool(response.json()["deleted"])


def kvsplice_counts(engine: Engine) -> dict[str, float]:
    prefix, suffix = "vllm:kvsplice_", "_total"
    return {
        name[len(prefix) : -len(suffix)]: value
        for name, value in engine.counters().items()
        if name.startswith(prefix) and name.endswith(suffix)
    }


def gauge(engine: Engine, name: str) -> float:
    """A gauge of the engine's /metrics, summed over its labels."""
    text = httpx.get(f"{engine.url}/metrics", timeout=30.0).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == name
    )  # fmt: skip


def in_flight(engine: Engine) -> float:
    """Requests the engine runs or has waiting."""
    return gauge(engine, "vllm:num_requests_running") + gauge(engine, "vllm:num_requests_waiting")


def breaker_open(engine: Engine) -> bool:
    return gauge(engine, "vllm:kvsplice_breaker_open") > 0


def hog_prompts(num_blocks: int, seed: int) -> list[list[int]]:
    """Prompts that together take `num_blocks` KV blocks and keep them while they decode up
    to `HOG_SLACK - 10` tokens (each ends `HOG_SLACK` tokens before its last block's end, so
    none needs another block: nothing is preempted, no block frees early). Random ids,
    new per seed: nothing of them is stored or cached."""
    rng, sizes = random.Random(seed), []
    while num_blocks > 0:
        sizes.append(min(HOG_BLOCKS, num_blocks))
        num_blocks -= sizes[-1]
    return [[rng.randrange(1000, 30000) for _ in range(n * BLOCK - HOG_SLACK)] for n in sizes]


def hold_blocks(engine: Engine, prompt: list[int], release: threading.Event) -> bool:
    """Stream a completion of `prompt` until `release` is set, then close the stream (vLLM
    aborts the request: its blocks free at once); whether it was still running then."""
    body = {"model": engine.spec.model_dir, "prompt": prompt, "max_tokens": HOG_SLACK - 10,
            "min_tokens": HOG_SLACK - 10, "temperature": 0.0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, timeout=600.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if release.is_set():
                return True
            if line == "data: [DONE]":
                break
    return False


@dataclass
class Soak:
    """Runs the schedule on the engines while `faults()` injects; collects what went wrong."""

    engines: dict[str, Engine]
    sidecar: Sidecar
    namespace: str
    fingerprint: str
    prompts: list[list[int]]
    expected: list[tuple[int, ...]]
    schedule: Schedule
    max_tokens: int
    failures: list[str] = field(default_factory=list)
    served: dict[int, int] = field(default_factory=dict)  # prompt -> last request index done
    counts: dict[str, object] = field(default_factory=dict)  # each fault: injected, observed
    num_done: int = 0
    num_probes: int = 0
    # per engine: set while its traffic may go (cleared while a fault step needs it idle)
    open_to: dict[str, threading.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            self.open_to[name] = threading.Event()
            self.open_to[name].set()

    def request(self, engine: str, k: int, label: str) -> None:
        try:
            got = (
                self.engines[engine]
                .complete(self.prompts[k], max_tokens=self.max_tokens, min_tokens=self.max_tokens)
                .token_ids
            )
            if got != self.expected[k]:
                self.failures.append(
                    f"{label} (prompt {k}) on {engine}: {got} != {self.expected[k]}"
                )
        except Exception as error:  # a failed request is a failure of the test
            self.failures.append(f"{label} (prompt {k}) on {engine} failed: {error!r}")

    def one(self, i: int) -> None:
        k, engine = self.schedule.prompt(i), self.schedule.engine(i)
        self.open_to[engine].wait()
        self.request(engine, k, f"request {i}")
        self.served[k] = i
        self.num_done += 1

    def probe(self, engines_and_prompts: list[tuple[str, int]]) -> None:
        with ThreadPoolExecutor(max(1, len(engines_and_prompts))) as pool:
            list(pool.map(lambda ek: self.request(ek[0], ek[1], "probe"), engines_and_prompts))
        self.num_probes += len(engines_and_prompts)

    def at(self, fraction: float) -> None:
        while self.num_done < self.schedule.num_requests * fraction:
            time.sleep(0.05)

    def targets(self, count: int, taken: set[int], only_by: str | None = None) -> list[int]:
        """Stored prompts no request served in the last 16 nor serves in the next 16 (no
        engine holds their blocks itself, no request races a probe); `only_by`: served
        by that engine alone, and by nobody for the next 120 (a probe of one on the other
        engine meets exactly what `only_by` stored)."""
        now, chosen = self.num_done, []
        for k, i in sorted(self.served.items(), key=lambda ki: ki[1]):
            runs = self.schedule.requests_of(k)
            past, soon = [j for j in runs if j <= i], [j for j in runs if j > i]
            ahead = 120 if only_by else 16
            if k in taken or i > now - 16 or any(j < now + ahead for j in soon):
                continue
            if only_by and any(self.schedule.engine(j) != only_by for j in past):
                continue
            if read_segment(
                self.sidecar, self.namespace, last_link(self.fingerprint, self.prompts[k])
            ):
                chosen.append(k)
                taken.add(k)
            if len(chosen) == count:
                return chosen
        raise AssertionError(f"no {count} prompts to probe (only by {only_by}) at request {now}")

    def deltas(self, before: dict[str, dict[str, float]], name: str,
               ready: Callable[[dict[str, float]], bool], timeout_s: float = 60.0,
               fail: bool = True) -> dict[str, float]:  # fmt: skip
        """Per engine, counter `name`'s growth since `before`, once `ready` holds for the
        growths (vLLM publishes connector stats each logging interval); after `timeout_s`
        an AssertionError (`fail`) or the growths as they are."""

        def grown() -> dict[str, float]:
            return {
                e: kvsplice_counts(self.engines[e]).get(name, 0.0) - before[e].get(name, 0.0)
                for e in ("a", "b")
            }

        try:
            return wait_for(grown, ready, timeout_s=timeout_s, interval_s=1.0)
        except AssertionError:
            if fail:
                raise
            return grown()

    def wait_breakers_closed(self) -> None:
        """Until both engines' sidecar breakers are closed (lookups asked again)."""

        def open_on() -> list[str]:
            return [e for e in ("a", "b") if breaker_open(self.engines[e])]

        wait_for(open_on, lambda names: not names, timeout_s=120.0, interval_s=1.0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {e: kvsplice_counts(self.engines[e]) for e in ("a", "b")}


def inject_faults(soak: Soak, stop_s: float, kv_blocks: int) -> dict[str, object]:
    """Each fault in turn, under the soak's load; returns, per fault, what was injected and
    what kvsplice counted (each count's window ends once it grew, or after a minute).
    `kv_blocks`: the engines' KV cache in blocks (`--num-gpu-blocks-override`)."""
    sidecar, taken = soak.sidecar, set[int]()
    counts: dict[str, object] = {}

    def crosswise(count: int, exact: bool = False) -> list[tuple[str, int]]:
        """`count` probes per engine (`exact`: of prompts only the other engine served)."""
        return [("a", k) for k in soak.targets(count, taken, "b" if exact else None)] + [
            ("b", k) for k in soak.targets(count, taken, "a" if exact else None)]  # fmt: skip

    soak.at(0.15)  # ---- the sidecar killed: probes look up while it is down
    probes, before = crosswise(1), soak.snapshot()
    os.killpg(sidecar.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
    sidecar.process.wait()  # type: ignore[union-attr]
    soak.probe(probes)
    sidecar.start()
    counts["sigkill"] = {"injected": 1, "failed_lookups": soak.deltas(
        before, "failed_lookups", lambda d: min(d.values()) >= 1)}  # fmt: skip

    soak.at(0.35)  # ---- a stored byte flipped in one link per engine: exactly those detected
    soak.wait_breakers_closed()  # else a probe's lookup is a miss and meets nothing
    probes, before = crosswise(1, exact=True), soak.snapshot()
    flipped = [last_link(soak.fingerprint, soak.prompts[k]) for _, k in probes]
    for key in flipped:
        corrupt_stored(sidecar, soak.namespace, key)
    soak.probe(probes)
    corrupt = soak.deltas(before, "corrupt_loads", lambda d: sum(d.values()) >= len(flipped))
    stored = set(stored_segment_ids(sidecar, soak.namespace))
    still_bad = [k.hex() for k in flipped if k.hex() in stored and not read_segment(
        sidecar, soak.namespace, k)]  # fmt: skip
    counts["corrupt"] = {"injected": len(flipped), "corrupt_loads": corrupt, "still_bad": still_bad}

    soak.at(0.55)  # ---- segments deleted between lookup and load
    tried = []
    for attempt in range(DELETE_ATTEMPTS):
        tried.append(delete_while_waiting(soak, taken, kv_blocks, seed=attempt))
        if tried[-1]["landed_while_waiting"]:
            break
    counts["deleted"] = {**tried[-1], "attempts": tried}

    soak.at(0.75)  # ---- the sidecar stopped: lookups time out, the breakers open
    probes, before = crosswise(3), soak.snapshot()
    os.killpg(sidecar.process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    stopped = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(soak.probe, probes)  # their lookups time out while it is stopped
        time.sleep(stop_s)
        # NOTE: stopped until each engine counted both (or 2 minutes): probes queued behind
        # traffic may look up only after a fixed pause, and would then meet nothing
        failed = soak.deltas(before, "failed_lookups", lambda d: min(d.values()) >= 1,
                             timeout_s=120.0, fail=False)  # fmt: skip
        trips = soak.deltas(before, "breaker_trips", lambda d: min(d.values()) >= 1,
                            timeout_s=max(1.0, 120.0 - (time.monotonic() - stopped)),
                            fail=False)  # fmt: skip
        os.killpg(sidecar.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
        stopped_s = time.monotonic() - stopped
        waiting.result(timeout=600)
    counts["sigstop"] = {
        "injected_s": round(stopped_s, 1), "failed_lookups": failed, "breaker_trips": trips,
    }  # fmt: skip
    return counts


def own_links(fingerprint: str, prompt: list[int]) -> list[bytes]:
    """The keys of the loadable blocks past the prompt's first (whose base others share)."""
    num_blocks = (len(prompt) - 1) // BLOCK
    return [link.key for link in chunk_links(fingerprint, prompt, BLOCK)[1:num_blocks]]


def delete_while_waiting(soak: Soak, taken: set[int], kv_blocks: int, seed: int) -> dict[str, Any]:
    """One probe on engine a looked up, then its links deleted while it waits for KV blocks,
    then loaded: kvsplice must count exactly one missing load. Engine a's traffic is held
    (it drains first); hogs take every block but the null block (each computed once
    first, so that all find their blocks cached and start in one step) and keep them while
    they decode; the probe's lookup is answered (the scheduler keeps the answer while the probe
    waits: vLLM asks again each step, the connector answers from it); the deletes land;
    the hogs' streams close (vLLM aborts them) and the probe loads what is gone.
    `landed_while_waiting`: the hogs still held every block and the probe still waited
    after the last delete."""
    engine, name = soak.engines["a"], "a"
    lookup_s = time.monotonic()
    soak.wait_breakers_closed()
    for gate in soak.open_to.values():  # both: the sidecar then answers the probe's lookup only
        gate.clear()
    try:
        for other in ("a", "b"):
            wait_for(partial(in_flight, soak.engines[other]), lambda n: n == 0,
                     timeout_s=300.0, interval_s=0.2)  # fmt: skip
        (k,) = soak.targets(1, taken)
        links = own_links(soak.fingerprint, soak.prompts[k])
        hogs = hog_prompts(kv_blocks - 1, seed)  # vLLM keeps one block back (its null block)
        for hog in hogs:  # computed once: its blocks cached, so the hogs start together
            engine.complete(hog, max_tokens=1)  # (no prefill, no lookup) and decode together
        release = threading.Event()
        with ThreadPoolExecutor(len(hogs) + 1) as pool:
            holding = [pool.submit(hold_blocks, engine, hog, release) for hog in hogs]
            try:
                wait_for(lambda: gauge(engine, "vllm:kv_cache_usage_perc"), lambda u: u >= 1.0,
                         timeout_s=120.0, interval_s=0.05)  # fmt: skip
                before, answered = soak.snapshot(), sidecar_lookups(soak.sidecar)
                probe = pool.submit(soak.probe, [(name, k)])
                # the sidecar counted its answer (found before the deletes): the connector
                # keeps that answer while the probe waits
                wait_for(lambda: sidecar_lookups(soak.sidecar), lambda n: n > answered,
                         timeout_s=60.0, interval_s=0.05)  # fmt: skip
                lookup_s = time.monotonic()
                deleted = sum(delete_segment(soak.sidecar, soak.namespace, link.hex())
                              for link in links)  # fmt: skip
                # NOTE: in time (the connector keeps a lookup's answer LOOKUP_MAX_AGE_S, 10 s)
                seen = {"hogs_holding": not any(hold.done() for hold in holding),
                        "probe_pending": not probe.done()}  # fmt: skip
                landed = bool(seen["hogs_holding"] and seen["probe_pending"])
            finally:
                release.set()  # the hogs end: the probe gets their blocks and loads
                released_s = time.monotonic() - lookup_s
            landed = all(hold.result(timeout=600) for hold in holding) and landed
            probe.result(timeout=600)
        missing = soak.deltas(before, "missing_loads", lambda d: d[name] >= 1,
                              timeout_s=60.0 if landed else 10.0, fail=False)  # fmt: skip
    finally:
        for gate in soak.open_to.values():
            gate.set()
    return {"injected": deleted, "probes": 1, "landed_while_waiting": landed, "seen": seen,
            "lookup_to_release_s": round(released_s, 2), "hogs": [len(h) for h in hogs],
            "missing_loads": missing}  # fmt: skip


def sidecar_lookups(sidecar: Sidecar) -> float:
    """The lookups the sidecar answered (`kvsplice_lookups_total`, every kind and result)."""
    text = httpx.get(f"{sidecar.admin_url}/metrics", timeout=30.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvsplice_lookups_total"))  # fmt: skip


def verify_stored(
    sidecar: Sidecar, namespace: str, engines: dict[str, Engine], prompts: list[list[int]]
) -> None:
    """Every stored segment reads back verified, and what engine B loads from the store
    (its own prefix cache emptied first) answers as the reference does."""
    ids = stored_segment_ids(sidecar, namespace)
    assert ids
    config = StoreClientConfig(same_host_reads=False)
    with StoreClient(sidecar.target, namespace, config=config) as client:
        unreadable = [i for i in ids if client.get_segment(i) is None]
    assert unreadable == [], f"{len(unreadable)} of {len(ids)} stored segments fail to verify"
    engines["b"].reset_prefix_cache()
    for prompt in prompts:
        expected = engines["reference"].complete(prompt, max_tokens=8, min_tokens=8)
        assert (
            engines["b"].complete(prompt, max_tokens=8, min_tokens=8).token_ids
            == expected.token_ids
        )
