"""The admin dashboard: `/dashboard` renders the store's state as HTML on the server.

Owns the page and its panels (namespaces with their token hit rate and approximate tokens,
tiers against capacity with the reads workers made in place, evictions, fault counters, the
most-read segments); `static/dashboard.js` only re-fetches
the panels and plots each namespace's hit rate over time. Nothing is fetched from the
internet. It reads the store through `AdminSource`, behind the admin API's own auth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from importlib.resources import files

from fastapi import FastAPI, Response
from fastapi.params import Depends
from fastapi.responses import HTMLResponse

from kvsplice.common import units
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.common.reuse_report import SERVED, token_hit_rate
from kvsplice.server.admin_models import AdminSource, SegmentHits, TierOverview

NUM_TOP_SEGMENTS = 10
REFRESH_MS = 2000
_SCRIPT = files("kvsplice.server").joinpath("static/dashboard.js")


def human_bytes(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else units.human_bytes(num_bytes)


def percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def _table(headers: Sequence[str], rows: Sequence[str], empty: str, num_left: int = 1) -> str:
    """A table whose first `num_left` columns are text and the rest right-aligned numbers."""
    head = "".join(
        f"<th{'' if i < num_left else ' class=num'}>{escape(h)}</th>" for i, h in enumerate(headers)
    )
    body = "".join(rows) or f'<tr><td colspan="{len(headers)}" class="empty">{empty}</td></tr>'
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def namespaces_panel(rows: Mapping[str, NamespaceStats]) -> str:
    cells = [
        f'<tr class="ns" data-namespace="{escape(ns)}" '
        f'data-hit-rate="{"" if r.hit_rate is None else r.hit_rate}">'
        f"<td>{escape(ns)}</td>"
        f'<td class="num" data-field="num_segments">{r.num_segments}</td>'
        f'<td class="num" data-field="stored_bytes" data-value="{r.num_bytes}">'
        f"{human_bytes(r.num_bytes)}</td>"
        f'<td class="num" data-field="hit_rate">{percent(r.hit_rate)}</td>'
        f'<td class="num" data-field="tokens">{r.num_hit_tokens} / {r.num_prompt_tokens}</td>'
        f'<td class="num" data-field="by_source">{_by_source(r)}</td>'
        f'<td class="num" data-field="approximate_tokens">{r.num_approximate_hit_tokens}</td>'
        "</tr>"
        for ns, r in rows.items()
    ]
    headers = (
        "namespace", "segments", "stored", "token hit rate", "tokens reused / prompt",
        "reused: local / in place / gRPC", "of them approximate",
    )  # fmt: skip
    return _table(headers, cells, "no namespace yet")


def _by_source(r: NamespaceStats) -> str:
    return " / ".join(str(r.hit_tokens.get(s, 0)) for s in SERVED)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _fill_bar(tier: TierOverview) -> str:
    if not tier.capacity_bytes:
        return human_bytes(tier.used_bytes)
    share = min(tier.used_bytes / tier.capacity_bytes, 1.0)
    return (
        f'<div class="bar"><div style="width:{100 * share:.1f}%"></div></div>'
        f"{human_bytes(tier.used_bytes)} of {human_bytes(tier.capacity_bytes)} "
        f"({100 * share:.0f}%)"
    )


def tiers_panel(tiers: Sequence[TierOverview]) -> str:
    cells = [
        f'<tr data-tier="{escape(t.tier)}"><td>{escape(t.tier)}</td>'
        f'<td class="fill" data-used="{t.used_bytes}">{_fill_bar(t)}</td>'
        f'<td class="num">{t.num_hits}</td><td class="num">{t.num_misses}</td>'
        f'<td class="num" data-field="in_place_reads">{_count(t.num_in_place_reads)}</td></tr>'
        for t in tiers
    ]
    headers = (
        "tier", "bytes used / capacity", "reads hit", "reads missed",
        "read in place (workers' reports)",
    )  # fmt: skip
    return _table(headers, cells, "-", num_left=2)


def evictions_panel(tiers: Sequence[TierOverview]) -> str:
    reasons = list(dict.fromkeys(r for t in tiers for r in t.evictions))
    cells = [
        f"<tr><td>{escape(t.tier)}</td>"
        + "".join(f'<td class="num">{t.evictions[r]}</td>' for r in reasons)
        + "</tr>"
        for t in tiers
    ]
    return _table(("tier", *reasons), cells, "-")


def faults_panel(tiers: Sequence[TierOverview]) -> str:
    cells = [
        f'<tr><td>{escape(t.tier)}</td><td class="num" data-field="checksum_failures">'
        f"{t.num_checksum_failures}</td>"
        f'<td class="num">{t.evictions.get("lost", 0)}</td>'
        f'<td class="num">{t.evictions.get("corrupt", 0)}</td></tr>'
        for t in tiers
    ]
    headers = ("tier", "checksum failures", "lost", "corrupt dropped")
    return _table(headers, cells, "-")


def top_panel(top: Sequence[SegmentHits]) -> str:
    cells = [
        f"<tr><td>{escape(s.namespace)}</td><td><code>{s.segment_id}</code></td>"
        f'<td class="num">{s.num_tokens}</td><td class="num">{human_bytes(s.payload_nbytes)}</td>'
        f'<td class="num">{s.num_hits}</td></tr>'
        for s in top
    ]
    headers = ("namespace", "segment id", "tokens", "size", "reads (local, in place, gRPC)")
    return _table(headers, cells, "no segment read yet", num_left=2)


def summary(rows: Mapping[str, NamespaceStats]) -> str:
    stats = rows.values()
    num_prompt_tokens = sum(r.num_prompt_tokens for r in stats)
    hit_rate = token_hit_rate(sum(r.num_hit_tokens for r in stats), num_prompt_tokens)
    exact_rate = token_hit_rate(sum(r.num_exact_hit_tokens for r in stats), num_prompt_tokens)
    return (
        f'<p id="summary"><b data-field="num_segments">{sum(r.num_segments for r in stats)}</b> '
        f"segments, <b>{human_bytes(sum(r.num_bytes for r in stats))}</b> stored, "
        f'token hit rate <b data-field="hit_rate">{percent(hit_rate)}</b> '
        f'(exact <b data-field="exact_hit_rate">{percent(exact_rate)}</b>) over '
        f"{len(rows)} namespaces</p>"
    )


def panels(source: AdminSource) -> str:
    """Every panel, as the page embeds it and `/dashboard/panels` returns it."""
    tiers = source.tier_overview()
    rows = source.namespace_stats(None)
    sections = (
        ("namespaces", "Namespaces (token hit rate = prompt tokens reused / prompt tokens, as workers report them)",
         summary(rows) + namespaces_panel(rows)),
        ("tiers", "Tiers against capacity (reads hit and missed: the sidecar's own reads)", tiers_panel(tiers)),
        ("evictions", "Evictions by reason", evictions_panel(tiers)),
        ("faults", "Faults", faults_panel(tiers)),
        ("top", f"Top {NUM_TOP_SEGMENTS} segments by reads", top_panel(source.top_segments(NUM_TOP_SEGMENTS))),
    )  # fmt: skip
    return "".join(
        f'<section id="{key}"><h2>{title}</h2>{table}</section>' for key, title, table in sections
    )


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvsplice dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5rem; color: #1d2433; background: #f6f7f9; }}
h1 {{ font-size: 1.3rem; margin: 0 0 .2rem; }} h2 {{ font-size: 1rem; margin: 0 0 .5rem; }}
#meta {{ color: #5a6272; margin-bottom: 1rem; }}
section, #history {{ background: #fff; border: 1px solid #dde1e8; border-radius: 6px;
  padding: .8rem 1rem; margin-bottom: 1rem; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ text-align: left; padding: .25rem .6rem; border-bottom: 1px solid #eceef2; }}
th {{ color: #5a6272; font-weight: 600; }} td.num, th.num {{ text-align: right; }}
#summary {{ margin: 0 0 .5rem; }} .axis {{ font-size: 11px; fill: #8a93a3; }}
td.empty {{ color: #8a93a3; }} code {{ font-size: 12px; }}
.bar {{ display: inline-block; width: 10rem; height: .7rem; background: #e6e9ef;
  border-radius: 3px; margin-right: .5rem; vertical-align: middle; }}
.bar div {{ height: 100%; background: #3b73d9; border-radius: 3px; }}
.grid {{ display: grid; grid-template-columns: 1fr 1fr; gap: 0 1rem; }}
#legend span {{ margin-right: 1rem; }}
</style></head>
<body data-refresh-ms="{refresh_ms}">
<h1>kvsplice dashboard</h1>
<div id="meta">version {version} · refreshes every {refresh_s:g} s ·
 <span id="updated">rendered by the server</span></div>
<div id="history"><h2>Token hit rate per namespace over time</h2>
<svg id="chart" width="100%" height="160" viewBox="0 0 600 160"></svg>
<div id="legend"></div></div>
<div id="panels">{panels}</div>
<script src="/dashboard/dashboard.js"></script>
</body></html>
"""


def add_dashboard(app: FastAPI, source: AdminSource, guarded: list[Depends], version: str) -> None:
    """`/dashboard` (page), `/dashboard/panels` (its refresh) and the script, behind `guarded`."""

    @app.get("/dashboard", dependencies=guarded, response_class=HTMLResponse)
    async def dashboard() -> str:
        return PAGE.format(
            panels=panels(source), version=escape(version),
            refresh_ms=REFRESH_MS, refresh_s=REFRESH_MS / 1000,
        )  # fmt: skip

    @app.get("/dashboard/panels", dependencies=guarded, response_class=HTMLResponse)
    async def dashboard_panels() -> str:
        return panels(source)

    @app.get("/dashboard/dashboard.js")
    async def dashboard_script() -> Response:
        # The script holds no data, so it is served without credentials.
        return Response(_SCRIPT.read_text(encoding="utf-8"), media_type="text/javascript")
