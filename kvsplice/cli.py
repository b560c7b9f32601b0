"""The `kvsplice` command line: the one place that reads flags and KVSPLICE_* env vars.

Each command builds a frozen config and hands it to a library entry point.
Imports are lazy so that `kvsplice serve` never loads torch or transformers.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="KV-cache reuse for multi-agent LLM inference: the store sidecar, worker tools, benchmarks.",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured in one run).")
app.add_typer(bench_app, name="bench")

DEFAULT_MODEL_CACHE = Path("~/.cache/kvsplice/models").expanduser()

ModelCacheOpt = Annotated[
    Path,
    typer.Option("--model-cache", envvar="KVSPLICE_MODEL_CACHE", help="Converted-model cache dir."),
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", envvar="KVSPLICE_MODEL", help="'smollm2' or a local HF model directory."
    ),
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", envvar="KVSPLICE_LOG_LEVEL")]


def _console():
    """A rich console; 160 columns when stdout is not a terminal (logs, CI), so tables stay whole."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _load_model(model: str, model_cache: Path):
    from kvsplice.client.models import ModelConfig, load_model

    return load_model(ModelConfig(source=model, cache_dir=model_cache))


@app.command()
def health(
    target: Annotated[str, typer.Option("--target", envvar="KVSPLICE_TARGET")] = "127.0.0.1:50051",
    timeout_s: Annotated[float, typer.Option("--timeout-s")] = 3.0,
) -> None:
    """Exit 0 if the sidecar's grpc.health.v1 Check answers SERVING (Docker healthcheck)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            typer.echo(f"unhealthy: {exc.code().name} {exc.details()}", err=True)
            raise typer.Exit(1) from exc
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    typer.echo(status)
    raise typer.Exit(0 if status == "SERVING" else 1)


def _split_host_port(address: str, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise typer.BadParameter(f"{flag} {address!r} must be host:port")
    return host.strip("[]"), int(port)


@app.command()
def serve(
    listen: Annotated[
        str, typer.Option(envvar="KVSPLICE_LISTEN", help="host:port or unix:/path")
    ] = "127.0.0.1:50051",
    admin_listen: Annotated[
        str,
        typer.Option(
            envvar="KVSPLICE_ADMIN_LISTEN", help="host:port of the admin HTTP API, or 'off'"
        ),
    ] = "127.0.0.1:8081",
    lmdb_path: Annotated[
        Path, typer.Option(envvar="KVSPLICE_LMDB_PATH", help="Durable tier directory.")
    ] = Path("kvsplice-data/lmdb"),
    lmdb_map_size_mib: Annotated[
        int, typer.Option(envvar="KVSPLICE_LMDB_MAP_SIZE_MIB", min=1)
    ] = 4096,
    lmdb_sync: Annotated[
        bool, typer.Option(envvar="KVSPLICE_LMDB_SYNC", help="fsync every commit.")
    ] = True,
    memory_mib: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_MEMORY_MIB", min=0, help="Memory tier budget; 0 disables it."
        ),
    ] = 1024,
    memory_policy: Annotated[
        str, typer.Option(envvar="KVSPLICE_MEMORY_POLICY", help="lru or lfu")
    ] = "lru",
    compress: Annotated[
        bool,
        typer.Option(
            envvar="KVSPLICE_COMPRESS", help="zstd on the LMDB tier (rarely pays on int8 KV)."
        ),
    ] = False,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="KVSPLICE_REDIS_URL", help="Shared Redis/Valkey tier, e.g. redis://valkey:6379/0"
        ),
    ] = None,
    quota_mib: Annotated[
        int | None, typer.Option(envvar="KVSPLICE_QUOTA_MIB", help="Per-namespace byte quota.")
    ] = None,
    default_ttl_s: Annotated[float | None, typer.Option(envvar="KVSPLICE_DEFAULT_TTL_S")] = None,
    max_payload_mib: Annotated[int, typer.Option(envvar="KVSPLICE_MAX_PAYLOAD_MIB", min=1)] = 256,
    chunk_mib: Annotated[int, typer.Option(envvar="KVSPLICE_CHUNK_MIB", min=1, max=64)] = 4,
    auth_token: Annotated[
        str | None, typer.Option(envvar="KVSPLICE_AUTH_TOKEN", help="Require 'Bearer <token>'.")
    ] = None,
    grace_period_s: Annotated[float, typer.Option(envvar="KVSPLICE_GRACE_PERIOD_S", min=0)] = 10.0,
    lsh_threshold: Annotated[float, typer.Option(envvar="KVSPLICE_LSH_THRESHOLD")] = 0.6,
    lsh_num_perm: Annotated[int, typer.Option(envvar="KVSPLICE_LSH_NUM_PERM")] = 128,
    anchor_capacity: Annotated[int, typer.Option(envvar="KVSPLICE_ANCHOR_CAPACITY", min=1)] = 20,
    anchor_window: Annotated[int, typer.Option(envvar="KVSPLICE_ANCHOR_WINDOW", min=1)] = 5,
    log_level: LogLevelOpt = "INFO",
) -> None:
    """Run the store sidecar (gRPC + admin HTTP API) until SIGTERM."""
    from kvsplice.index.anchor_pool import AnchorPoolConfig
    from kvsplice.index.similarity_index import SimilarityConfig
    from kvsplice.server.app import serve as run_server
    from kvsplice.server.config import MIB, SegmentServiceConfig, ServerConfig
    from kvsplice.storage.config import (
        LMDBTierConfig,
        MemoryTierConfig,
        RedisTierConfig,
        StoreConfig,
    )

    _setup_logging(log_level)
    admin_host, admin_port = (
        (None, None) if admin_listen == "off" else _split_host_port(admin_listen, "--admin-listen")
    )
    lmdb_path.mkdir(parents=True, exist_ok=True)
    store = StoreConfig(
        memory=MemoryTierConfig(max_bytes=memory_mib * MIB, policy=memory_policy)
        if memory_mib
        else None,
        lmdb=LMDBTierConfig(
            path=str(lmdb_path),
            map_size_bytes=lmdb_map_size_mib * MIB,
            compress=compress,
            sync=lmdb_sync,
        ),
        redis=RedisTierConfig(url=redis_url) if redis_url else None,
        default_quota_bytes=quota_mib * MIB if quota_mib else None,
    )
    config = ServerConfig(
        listen_address=listen,
        store=store,
        similarity=SimilarityConfig(threshold=lsh_threshold, num_perm=lsh_num_perm),
        anchor_pool=AnchorPoolConfig(capacity=anchor_capacity, window=anchor_window),
        service=SegmentServiceConfig(
            default_ttl_s=default_ttl_s, max_payload_nbytes=max_payload_mib * MIB
        ),
        auth_token=auth_token or None,
        chunk_nbytes=chunk_mib * MIB,
        grace_period_s=grace_period_s,
        admin_host=admin_host or "127.0.0.1",
        admin_port=admin_port,
    )
    run_server(config)


AdminUrlOpt = Annotated[str, typer.Option("--admin-url", envvar="KVSPLICE_ADMIN_URL")]
TokenOpt = Annotated[str | None, typer.Option("--auth-token", envvar="KVSPLICE_AUTH_TOKEN")]


def _admin_get(admin_url: str, path: str, params: dict[str, object], token: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(
            f"{admin_url.rstrip('/')}{path}", params=params, headers=headers, timeout=5.0
        )
    except httpx.HTTPError as exc:
        typer.echo(f"cannot reach the admin API at {admin_url}: {exc}", err=True)
        raise typer.Exit(2) from exc
    if reply.status_code != 200:
        typer.echo(f"{path}: HTTP {reply.status_code} {reply.text}", err=True)
        raise typer.Exit(1)
    return reply.json()


@app.command()
def stats(
    admin_url: AdminUrlOpt = "http://127.0.0.1:8081",
    namespace: Annotated[str | None, typer.Option("--namespace", "-n")] = None,
    auth_token: TokenOpt = None,
) -> None:
    """Per-namespace segments, bytes and hit rate from a running sidecar."""
    from rich.table import Table

    params = {"namespace": namespace} if namespace else {}
    body = _admin_get(admin_url, "/v1/stats", params, auth_token)
    table = Table("namespace", "segments", "bytes", "hits", "misses", "hit rate")
    for row in body.get("namespaces", []):
        rate = row.get("hit_rate")
        table.add_row(
            row["namespace"], str(row["num_segments"]), str(row["stored_bytes"]),
            str(row["num_hits"]), str(row["num_misses"]), "-" if rate is None else f"{rate:.1%}",
        )  # fmt: skip
    _console().print(table)


@app.command("ls")
def list_segments(
    namespace: Annotated[str, typer.Option("--namespace", "-n")],
    admin_url: AdminUrlOpt = "http://127.0.0.1:8081",
    offset: Annotated[int, typer.Option(min=0)] = 0,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    auth_token: TokenOpt = None,
) -> None:
    """List a namespace's segments, one page at a time."""
    from rich.table import Table

    params = {"namespace": namespace, "offset": offset, "limit": limit}
    body = _admin_get(admin_url, "/v1/segments", params, auth_token)
    table = Table("segment id", "tokens", "start", "layers", "bytes", "ttl s")
    for seg in body.get("segments", []):
        table.add_row(
            seg["segment_id"][:16], str(seg["num_tokens"]), str(seg["start_position"]),
            f"{seg['layer_start']}-{seg['layer_end']}", str(seg["payload_nbytes"]), str(seg.get("ttl_s") or "-"),
        )  # fmt: skip
    _console().print(table)
    if body.get("next_offset") is not None:
        typer.echo(f"more: --offset {body['next_offset']}")


StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar="KVSPLICE_STORE",
        help="host:port of a running sidecar; default: embedded.",
    ),
]


def _progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )
    task = bar.add_task("agent calls", total=None)

    def on_event(event: object) -> None:
        bar.update(task, completed=event.done, total=event.total, description=event.message[:60])

    return bar, on_event


MODES_HELP = (
    "Comma-separated mode variants; dense is the baseline. A variant is a mode, optionally "
    "with parameters after ':' joined by '+': blend:r=0.43, halo:h=4+eps=0.05, "
    "anchor:gamma=0.5+tau=0.1+metric=key+r=0.15, multicut:cut=16 (layers below the cut reused with "
    "no exact window; deeper cuts need the whole left context). Parameters: blend r; halo h, "
    "eps (a KL bound in nats, or none); anchor gamma, tau, metric, r (CacheBlend's ratio "
    "on the corrected K/V, or none), cover (the share of a placeholder its anchors must "
    "cover; 1: KVComm's length rule); multicut cut."
)


class Layout(StrEnum):
    """Prompt layouts (kvsplice.agents.layouts.LAYOUTS)."""

    persona_first = "persona-first"
    shared_first = "shared-first"
    transcript = "transcript"


LAYOUT_HELP = (
    "Where personas, the shared context and answers go: persona-first (KVComm's: each agent's "
    "own system prompt first), shared-first (a common preamble, the question and earlier "
    "answers first, each role's instruction last) or transcript (one growing group "
    "conversation: an agent prefills only its own turn). Fidelity is measured against dense "
    "prefill of the same layout."
)


@app.command()
def demo(
    store: StoreOpt = None,
    problems: Annotated[int, typer.Option(min=1, max=164, help="HumanEval problems.")] = 3,
    modes: Annotated[
        str | None,
        typer.Option(help=MODES_HELP + " Default: dense, exact, what --policy admits, then naive."),
    ] = None,
    layout: Annotated[Layout, typer.Option(help=LAYOUT_HELP)] = Layout.transcript,
    policy: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Admission policy JSON (kvsplice calibrate): its admitted modes join the "
            "default --modes. Without it only exact and dense are admitted.",
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 32,
    out_dir: Annotated[Path, typer.Option("--out")] = Path("results/demo"),
    auth_token: TokenOpt = None,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    log_level: LogLevelOpt = "WARNING",
) -> None:
    """The 5-agent HumanEval pipeline in each mode against the store; prints TTFT and fidelity."""

    from kvsplice.client.models import ModelConfig
    from kvsplice.eval.agents_demo import DemoConfig, demo_modes, render_demo, run_agents_demo

    _setup_logging(log_level)
    loaded = _load_model(model, model_cache) if policy is not None and modes is None else None
    config = DemoConfig(
        store_target=store,
        store_token=auth_token or None,
        num_problems=problems,
        modes=tuple(modes.split(",")) if modes else demo_modes(policy, loaded),
        layout=layout.value,
        max_new_tokens=max_new_tokens,
        out_dir=out_dir,
        model=ModelConfig(source=model, cache_dir=model_cache),
    )
    console = _console()
    console.print(
        "[bold]kvsplice demo[/]: loading the model (the first run converts the GGUF once)"
    )
    bar, on_event = _progress_bar()
    with bar:
        result = run_agents_demo(config, progress=on_event, loaded=loaded)
    for renderable in render_demo(result):
        console.print(renderable)


@bench_app.command("agents")
def bench_agents(
    workload: Annotated[str, typer.Option(help="synthetic, humaneval, math or mc")] = "synthetic",
    agents: Annotated[int, typer.Option("--agents", min=2, max=5)] = 5,
    modes: Annotated[str, typer.Option(help=MODES_HELP)] = "dense,exact,naive",
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            exists=True,
            dir_okay=False,
            help="Admission policy JSON (kvsplice calibrate) for this model: the base "
            "parameters of every variant (default: built-in defaults). Nothing is gated on it.",
        ),
    ] = None,
    samples: Annotated[int, typer.Option(min=1)] = 3,
    graph: Annotated[str, typer.Option(help="fully_connected or chain")] = "fully_connected",
    layout: Annotated[
        str,
        typer.Option(
            help=LAYOUT_HELP + " Several, comma-separated, run one after another on the same "
            "problems and write layouts.md / layouts.json beside their results."
        ),
    ] = "persona-first",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    prefix_len: Annotated[int, typer.Option(help="synthetic: system prompt tokens")] = 512,
    input_len: Annotated[int, typer.Option(help="synthetic: user input tokens")] = 256,
    response_len: Annotated[int, typer.Option(help="synthetic: tokens per response")] = 128,
    quant: Annotated[str, typer.Option(help="none, fp16 or int8 payloads")] = "none",
    data: Annotated[Path | None, typer.Option(help="GSM8K/MMLU-format JSONL for math/mc")] = None,
    out: Annotated[Path, typer.Option("--out")] = Path("results/bench_agents"),
    store: StoreOpt = None,
    store_memory_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="Embedded store's memory (every variant's namespace shares it; when full, "
            "the least recently used segments and anchors go).",
        ),
    ] = 2048,
    auth_token: TokenOpt = None,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    log_level: LogLevelOpt = "WARNING",
) -> None:
    """Multi-agent TTFT, reuse and fidelity per mode variant; writes JSON, markdown and PNG plots."""

    from dataclasses import replace

    from kvsplice.agents.layouts import check_layout
    from kvsplice.client.admission import load_policy
    from kvsplice.client.models import ModelConfig
    from kvsplice.common.errors import FingerprintMismatch
    from kvsplice.eval.bench_agents import (
        BenchAgentsConfig,
        run_bench_agents,
        run_bench_layouts,
    )
    from kvsplice.eval.report import render_bench_agents

    _setup_logging(log_level)
    layouts = tuple(dict.fromkeys(layout.split(",")))
    try:  # bad modes and layouts fail before the model loads
        for name in layouts:
            check_layout(name)
        config = BenchAgentsConfig(
            workload=workload, num_agents=agents, modes=tuple(modes.split(",")), samples=samples,
            graph=graph, layout=layouts[0], max_new_tokens=max_new_tokens, prefix_len=prefix_len, input_len=input_len,
            response_len=response_len, out_dir=out, store_target=store, store_token=auth_token or None,
            quant=quant, data_path=data, model=ModelConfig(source=model, cache_dir=model_cache),
            store_memory_mib=store_memory_mib,
        )  # fmt: skip
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    console = _console()
    console.print("[bold]kvsplice bench agents[/]: loading the model")
    loaded = _load_model(model, model_cache)
    if policy is not None:
        try:
            config = replace(
                config, admission=load_policy(policy, loaded.fingerprint), policy_path=policy
            )
        except (FingerprintMismatch, ValueError) as error:
            raise typer.BadParameter(str(error), param_hint="'--policy'") from error
    bar, on_event = _progress_bar()
    with bar:
        if len(layouts) == 1:
            results, files = [run_bench_agents(config, loaded, progress=on_event)], {}
        else:
            results, files = run_bench_layouts(config, layouts, loaded, progress=on_event)
    for result in results:
        console.print(f"[bold]{result.config.layout} layout[/]")
        for renderable in render_bench_agents(result):
            console.print(renderable)
    for name, path in files.items():
        console.print(f"{name}: {path}")


@app.command()
def calibrate(
    out: Annotated[
        Path, typer.Option("--out", help="Where to write the admission policy JSON.")
    ] = Path("policy.json"),
    probes: Annotated[
        int, typer.Option(min=1, help="Probe questions (math workload); anchor needs >= 3.")
    ] = 4,
    agents: Annotated[int, typer.Option("--agents", min=2, max=5)] = 3,
    max_kl: Annotated[
        float,
        typer.Option(help="Admit a mode only if its mean first-token KL is at most this (nats)."),
    ] = 0.05,
    min_agreement: Annotated[
        float, typer.Option(help="... and its first-token agreement with dense is at least this.")
    ] = 0.95,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    log_level: LogLevelOpt = "WARNING",
) -> None:
    """Measure each approximate mode's drift vs dense on this model and write the admission policy."""

    from kvsplice.client.models import ModelConfig
    from kvsplice.eval.calibrate import (
        CalibrationConfig,
        Thresholds,
        render_calibration,
        run_calibration,
        write_policy,
    )

    _setup_logging(log_level)
    config = CalibrationConfig(
        model=ModelConfig(source=model, cache_dir=model_cache),
        probes=probes,
        num_agents=agents,
        thresholds=Thresholds(max_mean_kl=max_kl, min_first_token_agreement=min_agreement),
    )
    console = _console()
    result = run_calibration(config, progress=lambda message: console.log(message))
    console.print(render_calibration(result))
    write_policy(result, out)
    console.print(f"admitted: {', '.join(result.policy.admitted_modes)} -> {out}")


@bench_app.command("core")
def bench_core(
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "256,1024,2048",
    repeats: Annotated[int, typer.Option(min=1)] = 5,
    log_level: LogLevelOpt = "WARNING",
) -> None:
    """Reuse path (decode + dequantize + shift + splice) vs dense prefill vs memcpy."""

    from kvsplice.eval.bench_core import render_core_bench, run_core_bench

    _setup_logging(log_level)
    loaded = _load_model(model, model_cache)
    rows = run_core_bench(loaded, lengths=_int_tuple(lengths), repeats=repeats)
    _console().print(render_core_bench(rows))


@bench_app.command("store")
def bench_store(
    sizes_mib: Annotated[
        str, typer.Option(help="Comma-separated segment sizes in MiB.")
    ] = "1,8,32",
    repeats: Annotated[int, typer.Option(min=1)] = 5,
    lookup_counts: Annotated[
        str, typer.Option(help="Comma-separated index sizes.")
    ] = "10000,100000",
    grpc_lookups: Annotated[bool, typer.Option(help="Also time lookups through gRPC.")] = True,
    tmp_dir: Annotated[Path | None, typer.Option(help="Where the benchmark's LMDB lives.")] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the result as JSON.")
    ] = None,
    log_level: LogLevelOpt = "WARNING",
) -> None:
    """Put/get MB/s (memory and LMDB tiers) beside numpy.copyto; lookup p50/p99 at 10k/100k."""
    import json

    from kvsplice.eval.bench_store import StoreBenchConfig, run_store_bench
    from kvsplice.eval.bench_store_render import render_store_bench, store_bench_to_json

    _setup_logging(log_level)
    config = StoreBenchConfig(
        sizes_mib=_int_tuple(sizes_mib),
        repeats=repeats,
        lookup_counts=_int_tuple(lookup_counts),
        tmp_dir=str(tmp_dir) if tmp_dir else None,
        include_grpc_lookups=grpc_lookups,
    )
    result = run_store_bench(config)
    console = _console()
    for renderable in render_store_bench(result):
        console.print(renderable)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(store_bench_to_json(result), indent=2))


def _int_tuple(csv: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in csv.split(","))
    except ValueError as exc:
        raise typer.BadParameter(f"{csv!r} is not a comma-separated list of integers") from exc


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
