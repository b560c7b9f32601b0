"""What every `kvsplice` command shares: option types, choices, logging, console, one-line errors.

Flags and KVSPLICE_* variables are read here and in the command modules only (typer's `envvar`
reads each variable beside its flag, with the flag's validation and help; pydantic-settings would
be a second source of truth for the same settings, so the CLI does not use it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:  # imported where used: `--help` stays quick
    from rich.console import Console

    from kvsplice.storeclient.config import ClientTls

DEFAULT_MODEL_CACHE = Path("~/.cache/kvsplice/models").expanduser()
WORKER_MODULES = ("torch", "transformers")
# kvsplice.client.model.packaged_models.PACKAGED_MODELS (it imports nothing heavy, but the
# CLI keeps its help free of worker imports); a test checks the two stay equal.
PACKAGED_MODEL_NAMES = ("smollm2", "qwen2.5-coder-0.5b")


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class CliError(Exception):
    """A user mistake or an environment problem: printed as one line, exit status `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def fail(message: str, exit_code: int = 1) -> NoReturn:
    raise CliError(message, exit_code)


ModelCacheOpt = Annotated[
    Path,
    typer.Option(
        "--model-cache", envvar="KVSPLICE_MODEL_CACHE", help="Converted-model cache directory."
    ),
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        envvar="KVSPLICE_MODEL",
        help="'smollm2' (SmolLM2-135M, bundled), 'qwen2.5-coder-0.5b' (Qwen2.5-Coder-0.5B-"
        "Instruct: `make qwen` installs it) or a local HF model directory.",
    ),
]


class Dtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DtypeOpt = Annotated[
    Dtype,
    typer.Option(
        "--dtype",
        envvar="KVSPLICE_DTYPE",
        help="Weights and K/V dtype. auto: the model's own (float32 for smollm2 and model "
        "directories, bfloat16 for qwen2.5-coder-0.5b). RoPE shifts are computed in float32 "
        "from the stored keys whatever the dtype.",
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        envvar="KVSPLICE_THREADS",
        min=1,
        help="torch threads for every timed forward (torch.set_num_threads); default: the "
        "machine's CPU cores (os.cpu_count()). Recorded, with the load average, in the JSON.",
    ),
]
LogLevelOpt = Annotated[
    LogLevel,
    typer.Option(
        "--log-level",
        envvar="KVSPLICE_LOG_LEVEL",
        case_sensitive=False,
        help="Logging threshold; 'debug' also shows tracebacks on errors.",
    ),
]
AuthTokenOpt = Annotated[
    str | None,
    typer.Option(
        "--auth-token", envvar="KVSPLICE_AUTH_TOKEN", help="Bearer token of the sidecar, if any."
    ),
]


TlsCaOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-ca", envvar="KVSPLICE_TLS_CA", help="CA (PEM) that signed the sidecar's cert: TLS."
    ),
]
TlsCertOpt = Annotated[
    Path | None,
    typer.Option(
        "--tls-cert", envvar="KVSPLICE_TLS_CERT", help="Client certificate (PEM), for mTLS."
    ),
]
TlsKeyOpt = Annotated[
    Path | None,
    typer.Option("--tls-key", envvar="KVSPLICE_TLS_KEY", help="Client key (PEM), for mTLS."),
]


TlsServerNameOpt = Annotated[
    str | None,
    typer.Option(
        "--tls-server-name",
        envvar="KVSPLICE_TLS_SERVER_NAME",
        help="Name to check the sidecar's cert against (default: the target's host).",
    ),
]


def client_tls(
    ca: Path | None, cert: Path | None, key: Path | None, server_name: str | None = None
) -> ClientTls | None:
    """The client side's TLS settings (`ClientTls`), or None for plaintext."""
    from kvsplice.storeclient.config import ClientTls

    if ca is None and cert is None and key is None:
        return None
    try:
        return ClientTls(
            ca_path=str(ca) if ca else None,
            cert_path=str(cert) if cert else None,
            key_path=str(key) if key else None,
            server_name=server_name or None,
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error


def setup_logging(level: LogLevel) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level.value.upper())  # also when a host already set handlers


def debug_enabled() -> bool:
    """True under `--log-level debug` (or KVSPLICE_LOG_LEVEL=debug): show tracebacks."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        return True
    return os.environ.get("KVSPLICE_LOG_LEVEL", "").lower() == "debug"


def console() -> Console:
    """A rich console: the terminal's width, else `COLUMNS` when set, else 160 columns
    (logs, CI: tables stay whole)."""
    from rich.console import Console

    columns = os.environ.get("COLUMNS", "")
    sized = sys.stdout.isatty() or (columns.isdigit() and int(columns) > 0)
    return Console(width=None if sized else 160)


def require_worker(command: str) -> None:
    """Fail in one line when a worker-only command runs in a sidecar-only install."""
    missing = [m for m in WORKER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        fail(
            f"`kvsplice {command}` needs the worker extra ({', '.join(missing)} missing): "
            "pip install '.[worker]' in a kvsplice checkout (or '<wheel>[worker]')"
        )


def split_host_port(address: str, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise typer.BadParameter(
            f"{address!r} must be host:port (port 0..65535)", param_hint=f"'{flag}'"
        )
    return host.strip("[]"), int(port)


def int_tuple(csv: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in csv.split(","))
    except ValueError as exc:
        raise typer.BadParameter(
            f"{csv!r} is not a comma-separated list of integers", param_hint=f"'{flag}'"
        ) from exc
    if any(v <= 0 for v in values):
        raise typer.BadParameter(f"{csv!r}: every value must be positive", param_hint=f"'{flag}'")
    return values
