"""The bench commands' flags are derived from their configs' fields: their names are a contract
(scripts and the docs call them), they read no KVSPLICE_* variable of their own, and `--help`
derives them without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from test_cli_errors import one_error_line, run_cli

from kvsplice.cli import app, main
from kvsplice.eval.bench.store.config import StoreBenchConfig

WORKER = ["--auth-token", "--model", "--model-cache", "--dtype", "--threads", "--log-level"]
FLAGS = {
    ("demo",): [
        "--store", "--problems", "--modes", "--layout", "--policy", "--max-new-tokens", "--out",
        *WORKER,
    ],
    ("bench", "agents"): [
        "--workload", "--agents", "--modes", "--policy", "--samples", "--seed", "--graph",
        "--layout", "--max-new-tokens", "--prefix-len", "--input-len", "--response-len", "--quant",
        "--data", "--out", "--store-memory-mib", "--store", *WORKER,
    ],
    ("bench", "judge"): [
        "--task", "--regime", "--layout", "--candidates", "--shuffle", "--no-shuffle", "--modes",
        "--seed", "--policy", "--json", "--data", "--examples", "--max-new-tokens",
        "--temperature", "--diagnostics", "--no-diagnostics", "--out", "--store", *WORKER,
    ],
    ("bench", "core"): [
        "--model", "--model-cache", "--dtype", "--lengths", "--threads", "--repeats", "--json",
        "--log-level",
    ],
    ("bench", "store"): [
        "--sizes-mib", "--path-sizes-mib", "--put-path-sizes-mib", "--repeats", "--lookup-counts", "--grpc-lookups",
        "--no-grpc-lookups", "--tmp-dir", "--json", "--log-level",
    ],
    ("bench", "vllm"): [
        "--json", "--configs", "--layout", "--answer-tokens", "--problem", "--workload", "--problems", "--concurrency", "--threads", "--dtype", "--repeats",
        "--prefix-caching", "--save-decode", "--no-save-decode", "--chunk-tokens", "--save-tails",
        "--no-save-tails", "--load-async",
        "--reuse-policy", "--work-dir",
        "--model", "--model-cache", "--log-level",
    ],
}  # fmt: skip
SHARED_VARIABLES = {
    "--store": "KVSPLICE_STORE", "--auth-token": "KVSPLICE_AUTH_TOKEN",
    "--model": "KVSPLICE_MODEL", "--model-cache": "KVSPLICE_MODEL_CACHE",
    "--dtype": "KVSPLICE_DTYPE", "--log-level": "KVSPLICE_LOG_LEVEL",
}  # fmt: skip


def options(path: tuple[str, ...]) -> list:  # type: ignore[type-arg]
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return [p for p in command.params if p.opts != ["-h", "--help"]]


@pytest.mark.parametrize("path", list(FLAGS), ids=" ".join)
def test_the_flag_names_stay_the_contract(path: tuple[str, ...]) -> None:
    names = [name for p in options(path) for name in (*p.opts, *p.secondary_opts)]
    assert names == FLAGS[path]


@pytest.mark.parametrize("path", list(FLAGS), ids=" ".join)
def test_only_the_shared_flags_read_variables(path: tuple[str, ...]) -> None:
    # bench core's --threads is a list, bench vllm's the engines' CPU binding: their own
    threads = "KVSPLICE_THREADS" if path not in (("bench", "core"), ("bench", "vllm")) else None
    expected = SHARED_VARIABLES | {"--threads": threads}
    if path == ("bench", "vllm"):  # its --dtype is the engines' own (float32 by default)
        expected["--dtype"] = None
    for option in options(path):
        assert option.envvar == expected.get(option.opts[0]), option.opts[0]


def test_the_cli_and_the_bench_help_import_no_torch() -> None:
    script = (
        "import sys\n"
        "from kvsplice.cli import main\n"
        "for argv in (['demo', '-h'], ['bench', 'agents', '-h'], ['bench', 'judge', '-h'],\n"
        "             ['bench', 'core', '-h'], ['bench', 'store', '-h'], ['bench', 'vllm', '-h']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'grpc') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def store_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> StoreBenchConfig:
    """The config `kvsplice bench store argv` would run (nothing is measured)."""
    seen: list[StoreBenchConfig] = []

    def run(config: StoreBenchConfig) -> None:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("kvsplice.eval.bench.store.bench.run_store_bench", run)
    with pytest.raises(SystemExit):
        main(["bench", "store", *argv])
    (config,) = seen
    return config


def test_bench_store_flags_set_their_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store_config([], monkeypatch) == StoreBenchConfig()
    argv = [
        "--sizes-mib", "2,4", "--path-sizes-mib", "", "--repeats", "1", "--lookup-counts", "10",
        "--no-grpc-lookups", "--tmp-dir", str(tmp_path), "--json", str(tmp_path / "r.json"),
    ]  # fmt: skip
    assert store_config(argv, monkeypatch) == StoreBenchConfig(
        sizes_mib=(2, 4), path_sizes_mib=(), repeats=1, lookup_counts=(10,),
        include_grpc_lookups=False, tmp_dir=str(tmp_path), json_path=str(tmp_path / "r.json"),
    )  # fmt: skip


def test_the_environment_does_not_change_a_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSPLICE_REPEATS", "9")
    monkeypatch.setenv("KVSPLICE_SIZES_MIB", "64")
    assert store_config([], monkeypatch) == StoreBenchConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["store", "--sizes-mib", "1,x"], "'--sizes-mib': '1,x' is not a comma-separated list"),
        (["store", "--lookup-counts", "0"], "'--lookup-counts': '0': every value must be >= 1"),
        (["core", "--threads", "1,-2"], "'--threads': '1,-2': every value must be >= 1"),
    ],
)
def test_a_bad_list_names_its_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["bench", *argv], capsys)
    assert code == 2 and message in one_error_line(err)


def built_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> object:
    """The config `kvsplice argv` builds before it loads the model (nothing is loaded)."""
    seen: list[object] = []

    def load(config: object, policy: object, command: str) -> None:
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("kvsplice.cli.worker.load_for_bench", load)
    monkeypatch.setattr("kvsplice.cli.judge.load_for_bench", load)
    with pytest.raises(SystemExit):
        main([*argv, "--threads", "1"])
    (config,) = seen
    return config


def test_bench_agents_and_judge_flags_set_their_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from kvsplice.client.modes.registry import MODES
    from kvsplice.eval.bench.agents.config import BenchAgentsConfig
    from kvsplice.eval.bench.judge.config import BenchJudgeConfig

    agents = built_config(["bench", "agents"], monkeypatch)
    assert isinstance(agents, BenchAgentsConfig) and agents.model.source == "smollm2"
    assert agents == BenchAgentsConfig(num_agents=5, model=agents.model)
    argv = ["--agents", "2", "--modes", "dense,exact", "--layout", "transcript,persona-first",
            "--graph", "CHAIN", "--out", "x", "--store", "h:1", "--auth-token", "t"]  # fmt: skip
    agents = built_config(["bench", "agents", *argv], monkeypatch)
    assert agents == BenchAgentsConfig(
        num_agents=2, modes=("dense", "exact"), layout="transcript", graph="chain",
        out_dir=Path("x"), store_target="h:1", store_token="t", model=agents.model,
    )  # fmt: skip
    judge = built_config(["bench", "judge"], monkeypatch)
    assert isinstance(judge, BenchJudgeConfig)
    assert judge.modes == tuple(MODES) and judge.max_new_tokens == 48
    judge = built_config(["bench", "judge", "--task", "humaneval", "--no-shuffle"], monkeypatch)
    assert isinstance(judge, BenchJudgeConfig)
    assert (judge.task, judge.max_new_tokens, judge.shuffle) == ("humaneval", 160, False)
