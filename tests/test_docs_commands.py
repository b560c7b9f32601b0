"""The docs check: every shell command in README.md and docs/*.md runs as written, or says why not.

A command is a line (continuations and open quotes joined) of a ```bash, ```sh, ```shell,
```console (its `$ ` lines) or unlabelled fenced block. Each runs through bash, in order
within its block, in a fresh directory, and must exit 0 (files persist between the commands
of a block, shell variables do not); or it is marked, with a reason:
- `<!-- docs-check: skip (REASON) -->` on the line before a block marks all its commands;
- a `# not run in CI: REASON` line inside a block marks the command that follows it;
- `MARKED_ELSEWHERE` marks commands of pages this check may not edit (docs/vllm.md).
A marked `kvsplice` command is still checked against the CLI (subcommand and options).

What the check substitutes, and nothing else:
- a `kvsplice serve` command runs in the background on ports the kernel picks (`:50051` and
  `:8081` become `:0`; KVSPLICE_LISTEN/KVSPLICE_ADMIN_LISTEN are `127.0.0.1:0`), is waited
  for (its startup line) and is stopped with SIGTERM at the block's end: it must exit 0;
- in the other commands `:50051` and `:8081` name the last sidecar the block started, else
  one this check started (KVSPLICE_TARGET and KVSPLICE_ADMIN_URL point at it too), which
  holds one segment in namespace `team-a` whose id is in SEGMENT_ID;
- /etc/kvsplice, /run/kvsplice, /var/lib/kvsplice and /data/ live under the block's directory;
  `.venv/bin/` and `.venv-vllm/bin/` are this interpreter's bin directory;
- Redis Cluster seeds `10.0.0.N:PORT` become `127.0.0.1:1` (refused: the sidecar starts
  degraded and serves, as documented).
The block's directory holds ca.pem, server.pem, server.key, client.pem, client.key and a
tenants.json with one admin tenant.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.serve_process import STARTUP, ServeProcess, start_serve
from helpers.store import make_meta, make_payload
from helpers.tls import make_pki
from test_compose_commands import argument_problems, cli_root, resolve

from kvsplice.server.tenants import Tenant, TenantTable, token_sha256
from kvsplice.storeclient.client import StoreClient

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
BLOCK_MARK = re.compile(r"<!--\s*docs-check:\s*skip\s*\((.+)\)\s*-->")
LINE_MARK = re.compile(r"^#\s*not run in CI:\s*(\S.*)$")
FENCE = re.compile(r"^(\s*)```([\w-]*)\s*$")
COMMAND_TIMEOUT_S = 120.0
SERVE_START_TIMEOUT_S = 90.0

# docs/vllm.md belongs to the connector's owner: its marks live here, by command prefix.
VLLM_ENGINE = "starts a vLLM engine (minutes); tests/integrations/vllm/engine starts real ones"
MARKED_ELSEWHERE = [
    ("docs/vllm.md", "make vllm", "installs vLLM (minutes, network); make test builds it"),
    ("docs/vllm.md", "python3 -m venv .venv-vllm", "the by-hand install of make vllm"),
    ("docs/vllm.md", ".venv-vllm/bin/pip ", "the by-hand install of make vllm (network)"),
    ("docs/vllm.md", ".venv-vllm/bin/python -m vllm.entrypoints", VLLM_ENGINE),
]


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # 1-based, where the command starts
    text: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    commands: tuple[Command, ...]


def read_blocks(path: Path) -> list[Block]:
    """The shell blocks of one page, each with its commands and their marks."""
    lines, blocks, i = path.read_text().splitlines(), [], 0
    page = str(path.relative_to(ROOT))
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence.group(2) in SHELL_LANGUAGES:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            block_mark = BLOCK_MARK.search(before)
            body = [line[len(fence.group(1)) :] for line in lines[i + 1 : end]]
            console = fence.group(2) == "console"
            commands = split_commands(page, i + 2, body, console, block_mark and block_mark[1])
            blocks.append(Block(page, i + 1, tuple(commands)))
        i = end + 1
    return blocks


def split_commands(
    page: str, first_line: int, body: list[str], console: bool, block_reason: str | None
) -> list[Command]:
    commands, pending, start, reason = [], "", 0, None
    for offset, raw in enumerate(body):
        line = raw[2:] if console and raw.startswith("$ ") else raw
        mark = None if pending else LINE_MARK.match(line.strip())
        if mark:
            reason = mark[1]
            continue
        if console and not raw.startswith("$ ") and not pending:
            continue  # console output
        if not pending:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = first_line + offset
        pending += line + "\n"
        if pending.rstrip().endswith("\\") or not _complete(pending):
            continue
        text = pending.strip()
        skip = block_reason or reason or _marked_elsewhere(page, text)
        commands.append(Command(page, start, text, skip))
        pending, reason = "", None
    assert not pending, f"{page}:{start}: a command never ends (an open quote?)"
    assert reason is None, f"{page}: `# not run in CI: {reason}` marks no command"
    return commands


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # "No closing quotation": the command goes on in the next line
        return False
    return True


def _marked_elsewhere(page: str, text: str) -> str | None:
    marks = (why for p, prefix, why in MARKED_ELSEWHERE if p == page and text.startswith(prefix))
    return next(marks, None)


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
COMMANDS = [command for block in BLOCKS for command in block.commands]


# ---- substitutions -----------------------------------------------------------------------

SERVE = re.compile(r"(^|\s)((?:\S*/)?kvsplice\s+serve\b)")
KVSPLICE_ARGV0 = re.compile(r"^(?:\S*/)?kvsplice$")


def substituted(text: str, workdir: Path, ports: tuple[str, str]) -> str:
    grpc_port, admin_port = ports
    text = re.sub(r"(?<=:)50051\b", grpc_port, text)
    text = re.sub(r"(?<=:)8081\b", admin_port, text)
    text = re.sub(r"\b10\.0\.0\.\d+:\d+", "127.0.0.1:1", text)
    text = re.sub(
        r"(?<![\w.~/-])/(etc/kvsplice|run/kvsplice|var/lib/kvsplice|data/)", f"{workdir}/\\1", text
    )
    return re.sub(r"(?<![\w./-])\.venv(?:-vllm)?/bin/", f"{Path(sys.executable).parent}/", text)


def make_workdir() -> Path:
    # NOTE: short, under /tmp: a unix socket path must stay under 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="kvdoc-"))
    for sub in ("etc/kvsplice", "run/kvsplice", "var/lib/kvsplice", "data"):
        (workdir / sub).mkdir(parents=True)
    make_pki(workdir)  # ca.pem, server.pem, server.key, client.pem, client.key
    ops = Tenant("ops", token_sha256("docs-check-admin-token"), (), "admin")
    (workdir / "tenants.json").write_text(TenantTable((ops,)).dumps())
    return workdir


def base_env(target: str, admin_url: str, segment_id: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLICE_")}
    bindir = str(Path(sys.executable).parent)
    return {
        **keep, "PATH": f"{bindir}{os.pathsep}{keep.get('PATH', '')}",
        "KVSPLICE_LISTEN": "127.0.0.1:0", "KVSPLICE_ADMIN_LISTEN": "127.0.0.1:0",
        "KVSPLICE_TARGET": target, "KVSPLICE_ADMIN_URL": admin_url,
        "KVSPLICE_MODEL_CACHE": os.environ.get("KVSPLICE_MODEL_CACHE", ""),
        "SEGMENT_ID": segment_id,
    }  # fmt: skip


# ---- running a block ---------------------------------------------------------------------


@dataclass
class Sidecar:
    """Where a sidecar listens: gRPC and admin ports for the substitution, and URLs."""

    target: str
    admin_url: str

    @property
    def ports(self) -> tuple[str, str]:
        return self.target.rsplit(":", 1)[-1], self.admin_url.rsplit(":", 1)[-1]


class BlockRun:
    """The commands of one block, run in order in one directory; its sidecars stopped last."""

    def __init__(self, block: Block, default: Sidecar, segment_id: str) -> None:
        self.block = block
        self.segment_id = segment_id
        self.workdir = make_workdir()
        self.sidecar = default
        self.serves: list[tuple[Command, subprocess.Popen[bytes], Path]] = []

    def run(self) -> None:
        try:
            for command in self.block.commands:
                if command.skip_reason is None:
                    self._run(command)
        except BaseException:
            self._stop_serves(check=False)  # the first failure is the one to report
            raise
        else:
            self._stop_serves(check=True)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self, command: Command) -> None:
        env = base_env(self.sidecar.target, self.sidecar.admin_url, self.segment_id)
        if SERVE.search(command.text):
            self._start_serve(command, env)
            return
        text = substituted(command.text, self.workdir, self.sidecar.ports)
        done = subprocess.run(
            ["bash", "-c", f"set -o pipefail\n{text}"], cwd=self.workdir, env=env,
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"{command.where}: `{command.text}` ran as `{text}` and exited {done.returncode}:\n"
            f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )

    def _start_serve(self, command: Command, env: dict[str, str]) -> None:
        text = substituted(command.text, self.workdir, ("0", "0")).rstrip().removesuffix("&")
        log = self.workdir / f"serve-{len(self.serves)}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", SERVE.sub(r"\1exec \2", text, count=1)], cwd=self.workdir,
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.serves.append((command, process, log))
        found = wait_for_startup(process, log)
        assert found is not None, (
            f"{command.where}: `{text}` did not start:\n{log.read_text()[-3000:]}"
        )
        target, admin_url = found
        self.sidecar = Sidecar(target.replace("0.0.0.0", "127.0.0.1"), admin_url or "")

    def _stop_serves(self, check: bool) -> None:
        for command, process, log in reversed(self.serves):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                code = process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
            assert code == 0 or not check, (
                f"{command.where}: the sidecar exited {code} on SIGTERM:\n{log.read_text()[-3000:]}"
            )


def wait_for_startup(process: subprocess.Popen[bytes], log: Path) -> tuple[str, str] | None:
    """(gRPC target, admin URL or "") from the startup line; None if the process ended."""
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        found = STARTUP.search(log.read_text(errors="replace"))
        if found:
            return found[1], found[2] or ""
        time.sleep(0.1)
    return None


@pytest.fixture(scope="module")
def default_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    workdir = tmp_path_factory.mktemp("docs-sidecar")
    serve = start_serve(workdir, "--lmdb-path", str(workdir / "lmdb"))
    yield serve
    serve.stop()


def store_one_segment(target: str, block_line: int) -> str:
    """The id of a new segment in `team-a`, for the `ls`/`delete` recipes to show and delete."""
    payload = make_payload(1024, seed=block_line)
    meta = make_meta([block_line, 1, 2, 3], payload, namespace="team-a")
    with StoreClient(target, "team-a") as store:
        assert store.put_segment(meta, payload)
    return meta.segment_id


RUNNABLE = [block for block in BLOCKS if any(c.skip_reason is None for c in block.commands)]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: f"{block.page}:{block.line}")
def test_the_block_runs_as_written(block: Block, default_sidecar: ServeProcess) -> None:
    assert default_sidecar.admin_url is not None
    segment_id = store_one_segment(default_sidecar.target, block.line)
    default = Sidecar(default_sidecar.target, default_sidecar.admin_url)
    BlockRun(block, default, segment_id).run()


def _kvsplice_argv(text: str) -> list[str] | None:
    """The argv of a plain `kvsplice ...` command (no pipes, substitutions or redirections)."""
    if any(op in text for op in ("|", "&&", ";", "$(", ">", "<")):
        return None
    argv = shlex.split(text.replace("\\\n", " "), comments=True)
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        argv = argv[1:]
    return ["kvsplice", *argv[1:]] if argv and KVSPLICE_ARGV0.match(argv[0]) else None


MARKED_KVSPLICE = [
    (c, argv) for c in COMMANDS if c.skip_reason and (argv := _kvsplice_argv(c.text)) is not None
]


@pytest.mark.parametrize(
    ("command", "argv"), MARKED_KVSPLICE, ids=lambda x: getattr(x, "where", "")
)
def test_a_marked_kvsplice_command_names_real_options(command: Command, argv: list[str]) -> None:
    leaf, args = resolve(cli_root(), argv, command.where)
    assert argument_problems(leaf, args, env=()) == [], f"{command.where}: `{command.text}`"


def test_the_check_finds_the_pages_commands_and_every_mark_has_a_reason() -> None:
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "docs/operations.md", "docs/vllm.md"} <= pages
    readme_runs = [c for c in COMMANDS if c.page == "README.md" and c.skip_reason is None]
    assert any("kvsplice serve" in c.text for c in readme_runs), "the README's sidecar is run"
    assert all(c.skip_reason is None or c.skip_reason.strip() for c in COMMANDS)


def test_the_parser_splits_continuations_and_open_quotes_and_reads_marks() -> None:
    body = [
        "# not run in CI: an engine",
        'serve --config \'{"a":',
        "  1}' \\",
        "  --port 1",
        "echo ok  # a comment",
    ]
    first, second = split_commands("x.md", 10, body, console=False, block_reason=None)
    assert first.line == 11 and first.skip_reason == "an engine" and "--port 1" in first.text
    assert second == Command("x.md", 14, "echo ok  # a comment", None)
    (only,) = split_commands("x.md", 1, ["$ kvsplice ls", "output"], console=True, block_reason="r")
    assert only.text == "kvsplice ls" and only.skip_reason == "r"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#{1,6} (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_internal_links_name_files_and_headings_that_exist(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not links in code
    broken = []
    for link in LINK.findall(text):
        if re.match(r"^[a-z]+:", link):
            continue  # http(s):, mailto:
        file, _, anchor = link.partition("#")
        target = (page.parent / file).resolve() if file else page
        if not target.exists() or (anchor and anchor not in heading_anchors(target)):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def summary() -> str:
    """How many commands run and how many are marked, by reason (`python tests/test_docs_commands.py`)."""
    marked: dict[str, int] = {}
    for c in COMMANDS:
        if c.skip_reason:
            marked[c.skip_reason] = marked.get(c.skip_reason, 0) + 1
    runs = sum(c.skip_reason is None for c in COMMANDS)
    lines = [
        f"{len(COMMANDS)} commands in {len(PAGES)} pages: {runs} run, {len(COMMANDS) - runs} marked"
    ]
    lines += [f"  {n:3d}  {why}" for why, n in sorted(marked.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary())
