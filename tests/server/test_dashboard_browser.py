"""The dashboard in a real headless Chromium against a live sidecar: its numbers are /v1/stats'.

Debian's chromium (`make setup` installs it) driven by Playwright from PyPI; never a
downloaded browser. Set KVSPLICE_UPDATE_SCREENSHOTS=1 to refresh docs/img/dashboard.png.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.store import make_meta

from kvsplice.common.reuse_report import ReusedRun
from kvsplice.common.segment import SegmentMeta
from kvsplice.server.dashboard import human_bytes
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
FINGERPRINT = "kvfp1-" + "0" * 32
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
TOKEN = "dashboard-test-token"

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) missing")
if not CHROMIUM.exists():
    pytest.skip(
        "no /usr/bin/chromium: `make setup` installs Debian's chromium", allow_module_level=True
    )


def make_segment(namespace: str, tokens: tuple[int, ...], nbytes: int) -> tuple[SegmentMeta, bytes]:
    payload = random.Random(hash(tokens)).randbytes(nbytes)
    return make_meta(tokens, payload, namespace=namespace, fingerprint=FINGERPRINT), payload


def fill(target: str, namespace: str, num_segments: int, hits: int, misses: int) -> None:
    """`num_segments` 8-token segments; `hits` calls of 16 prompt tokens that reuse 8 of them
    (read over gRPC, locally and in place, in turn; every third approximate), `misses` that
    reuse none: what workers report."""
    with StoreClient(target, namespace, token=TOKEN) as client:
        metas = []
        for i in range(num_segments):
            meta, payload = make_segment(namespace, tuple(range(8 * i, 8 * i + 8)), 20_000 + i)
            assert client.put_segment(meta, payload)
            metas.append(meta)
        for i in range(hits):  # 8 of 16 tokens stored
            meta = metas[i % num_segments]
            client.lookup_prefix(FINGERPRINT, [*meta.token_ids, *[9999] * 8])
            client.get_segment(meta.segment_id)
            served = ("grpc", "local", "in_place")[i % 3]
            client.report_reuse(16, [ReusedRun(8, served, meta.context_key, exact=i % 3 != 1)])
        for _ in range(misses):
            client.lookup_prefix(FINGERPRINT, [7777] * 16)
            client.report_reuse(16)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[EmbeddedStore]:
    config = loopback_config(str(tmp_path / "lmdb"), admin_port=0, auth_token=TOKEN)
    (tmp_path / "lmdb").mkdir()
    with EmbeddedStore(config) as store:
        yield store


def stats(store: EmbeddedStore) -> dict[str, dict]:
    reply = httpx.get(f"{store.admin_url}/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    return {row["namespace"]: row for row in reply.json()["namespaces"]}


def rendered_rows(page) -> dict[str, dict[str, str]]:
    return page.eval_on_selector_all(
        "#namespaces tr.ns",
        """rows => Object.fromEntries(rows.map(r => [r.dataset.namespace, {
            segments: r.querySelector('[data-field=num_segments]').textContent,
            stored: r.querySelector('[data-field=stored_bytes]').textContent,
            stored_bytes: r.querySelector('[data-field=stored_bytes]').dataset.value,
            hit_rate: r.querySelector('[data-field=hit_rate]').textContent,
            tokens: r.querySelector('[data-field=tokens]').textContent,
            approximate: r.querySelector('[data-field=approximate_tokens]').textContent}]))""",
    )


def expected_rows(store: EmbeddedStore) -> dict[str, dict[str, str]]:
    return {
        ns: {
            "segments": str(row["num_segments"]),
            "stored": human_bytes(row["stored_bytes"]),
            "stored_bytes": str(row["stored_bytes"]),
            "hit_rate": f"{100 * row['hit_rate']:.1f}%",
            "tokens": f"{row['num_hit_tokens']} / {row['num_requested_tokens']}",
            "approximate": str(row["num_approximate_hit_tokens"]),
        }
        for ns, row in stats(store).items()
    }


def test_the_dashboard_shows_what_v1_stats_says_and_refreshes(
    sidecar: EmbeddedStore, tmp_path: Path
) -> None:
    fill(sidecar.target, "team-a", num_segments=6, hits=6, misses=2)  # 48/128 tokens
    fill(sidecar.target, "team-b", num_segments=3, hits=3, misses=0)  # 24/48 tokens
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        context = browser.new_context(
            viewport={"width": 1100, "height": 900},
            extra_http_headers={"Authorization": f"Bearer {TOKEN}"},
        )
        page = context.new_page()
        page.goto(f"{sidecar.admin_url}/dashboard")
        first = rendered_rows(page)
        assert first == expected_rows(sidecar)
        assert first["team-a"]["hit_rate"] == "37.5%" and first["team-b"]["hit_rate"] == "50.0%"
        assert first["team-a"]["approximate"] == "16"  # calls 1 and 4 of six: 8 tokens each

        fill(sidecar.target, "team-b", num_segments=3, hits=6, misses=4)  # the page refreshes
        page.wait_for_function(
            "tokens => document.querySelector("
            "'#namespaces tr[data-namespace=team-b] [data-field=tokens]').textContent === tokens",
            arg=expected_rows(sidecar)["team-b"]["tokens"],
            timeout=15_000,
        )
        assert rendered_rows(page) == expected_rows(sidecar)
        assert page.locator("#chart polyline").count() == 2
        assert page.locator("#top tbody tr").count() == 9  # every segment read at least once
        page.wait_for_timeout(2500)  # one more refresh: the chart has a line, not a point
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("KVSPLICE_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, SCREENSHOT)


def test_the_dashboard_needs_the_admin_token(sidecar: EmbeddedStore) -> None:
    assert httpx.get(f"{sidecar.admin_url}/dashboard").status_code == 401
    assert httpx.get(f"{sidecar.admin_url}/dashboard/panels").status_code == 401
