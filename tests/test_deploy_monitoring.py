"""deploy/: the Grafana dashboard queries only series the sidecar exports; compose wires it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml

from kvsplice.server.embedded import EmbeddedStore, loopback_config

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvsplice.json"
SERIES = re.compile(r"\b((?:kvsplice|process)_[a-z_]+)\b")


def dashboard_series() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {name for p in panels for t in p["targets"] for name in SERIES.findall(t["expr"])}


def test_every_grafana_query_names_an_exported_series(tmp_path: Path) -> None:
    with EmbeddedStore(loopback_config(str(tmp_path), admin_port=0)) as store:
        text = httpx.get(f"{store.admin_url}/metrics").text
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    # A labelled histogram has no samples before its first observation: take declared families.
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    exported = samples | declared
    wanted = dashboard_series()
    assert {"kvsplice_tier_used_bytes", "kvsplice_evictions_total", "kvsplice_build_info"} <= wanted
    for name in wanted:
        base = name.removesuffix("_bucket").removesuffix("_count")
        assert name in exported or base in declared, name


def test_every_panel_has_a_unique_place_and_id() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    places = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(places) == len(panels)


def test_the_monitoring_profile_scrapes_the_admin_port() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert compose["prometheus"]["profiles"] == ["monitoring"] == compose["grafana"]["profiles"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (target,) = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == "kvsplice:8081"
    assert "--admin-listen" in compose["kvsplice"]["command"]
    assert compose["kvsplice"]["command"][
        compose["kvsplice"]["command"].index("--admin-listen") + 1
    ].endswith(":8081")
    for mount in compose["grafana"]["volumes"] + compose["prometheus"]["volumes"]:
        source = mount.split(":")[0]
        assert not source.startswith("./") or (ROOT / source).exists(), source


def test_the_sidecar_outlives_its_drain_and_the_worker_keeps_results() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    grace_s = int(compose["kvsplice"]["stop_grace_period"].removesuffix("s"))
    assert grace_s > 10 + 5  # the sidecar's 10 s drain, then closing LMDB
    command = compose["worker"]["command"]
    out = command[command.index("--out") + 1]
    assert any(out.startswith(v.split(":")[1]) for v in compose["worker"]["volumes"])
