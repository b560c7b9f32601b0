"""The worker snippet of docs/client-api.md (once the README's) runs as written against a
live sidecar, and the sidecar's stats count the reuse the worker printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from kvsplice.cli import main
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec

CLIENT_API = Path(__file__).resolve().parent.parent / "docs" / "client-api.md"
TARGET = '"127.0.0.1:50051"'
REUSED = re.compile(r"^(\d+)/(\d+) tokens reused", re.M)


def worker_snippet() -> str:
    section = CLIENT_API.read_text().split("## Using the client from a worker", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_snippet(target: str) -> None:
    snippet = worker_snippet()
    assert TARGET in snippet
    exec(compile(snippet.replace(TARGET, repr(target)), "docs/client-api.md", "exec"), {})


@pytest.mark.slow
def test_sidecar_on_the_workers_host_counts_the_reuse_the_worker_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = SidecarSpec(str(tmp_path / "lmdb"), map_size_bytes=256 << 20, admin=True)
    with SidecarProcess(spec) as sidecar:
        run_snippet(sidecar.target)  # `store.close()` sends the last reuse report
        calls = [(int(a), int(b)) for a, b in REUSED.findall(capsys.readouterr().out)]
        with pytest.raises(SystemExit):
            main(["stats", "--json", "--admin-url", str(sidecar.admin_url), "-n", "team-a"])
        (row,) = json.loads(capsys.readouterr().out)["namespaces"]
        top = httpx.get(f"{sidecar.admin_url}/dashboard/panels").text.split('id="top"')[1]
    assert len(calls) == 2 and calls[0][0] == 0 and calls[1][0] > 0  # the second reuses
    num_reused, num_prompt = sum(a for a, _ in calls), sum(b for _, b in calls)
    assert (row["num_hit_tokens"], row["num_requested_tokens"]) == (num_reused, num_prompt)
    assert row["hit_rate"] == pytest.approx(num_reused / num_prompt)
    assert sum(row["hit_tokens_by_source"].values()) == num_reused and row["num_calls"] == 2
    assert "no segment read yet" not in top and "team-a" in top
