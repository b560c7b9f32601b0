"""The README's worker snippet runs as written against a live sidecar."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsplice.server.embedded import EmbeddedStore, loopback_config

README = Path(__file__).resolve().parent.parent / "README.md"


def worker_snippet() -> str:
    section = README.read_text().split("## Using the client from a worker", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_worker_snippet_reuses_the_system_prompt(tmp_path: Path, capsys) -> None:
    snippet = worker_snippet()
    assert '"127.0.0.1:50051"' in snippet
    store = EmbeddedStore(loopback_config(str(tmp_path / "lmdb")))
    store.start()
    try:
        exec(
            compile(snippet.replace('"127.0.0.1:50051"', repr(store.target)), "README", "exec"), {}
        )
    finally:
        store.stop()
    out = capsys.readouterr().out
    reused = [int(n) for n in re.findall(r"^(\d+)/\d+ tokens reused", out, re.M)]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 0
