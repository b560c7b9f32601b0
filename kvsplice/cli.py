"""The `kvsplice` command line: the one place that reads flags and KVSPLICE_* env vars.

Each command builds a frozen config and hands it to a library entry point.
Imports are lazy so that `kvsplice serve` never loads torch or transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured in one run).")
app.add_typer(bench_app, name="bench")

DEFAULT_MODEL_CACHE = Path("~/.cache/kvsplice/models").expanduser()

ModelCacheOpt = Annotated[
    Path,
    typer.Option("--model-cache", envvar="KVSPLICE_MODEL_CACHE", help="Converted-model cache dir."),
]
ModelOpt = Annotated[
    str,
    typer.Option("--model", envvar="KVSPLICE_MODEL", help="'smollm2' or a local HF model directory."),
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", envvar="KVSPLICE_LOG_LEVEL")]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _load_model(model: str, model_cache: Path):  # noqa: ANN202 - torch types stay lazy
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


@bench_app.command("core")
def bench_core(
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "256,1024,2048",
    repeats: Annotated[int, typer.Option(min=1)] = 5,
    log_level: LogLevelOpt = "WARNING",
) -> None:
    """Reuse path (decode + dequantize + shift + splice) vs dense prefill vs memcpy."""
    from rich.console import Console

    from kvsplice.eval.bench_core import render_core_bench, run_core_bench

    _setup_logging(log_level)
    loaded = _load_model(model, model_cache)
    rows = run_core_bench(loaded, lengths=tuple(int(x) for x in lengths.split(",")), repeats=repeats)
    Console().print(render_core_bench(rows))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
