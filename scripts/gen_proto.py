"""Regenerate store_pb2.py, store_pb2_grpc.py, store_pb2.pyi from proto/kvsplice/v1/store.proto.

Output goes to proto/ (the one place generated code lives), imports rewritten to
`kvsplice.proto`. `--check` regenerates into a temp dir and exits 1 if proto/ is stale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
PROTO_FILES = ("kvsplice/v1/store.proto",)
# protoc emits `from kvsplice.v1 import store_pb2`; the package is kvsplice.proto.
IMPORT_REWRITES = (("from kvsplice.v1 import ", "from kvsplice.proto import "),)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _run_protoc(out_dir: Path) -> None:
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(PROTO_FILES)}")


def _rewrite_imports(text: str) -> str:
    for old, new in IMPORT_REWRITES:
        text = text.replace(old, new)
    return text


def generate() -> dict[str, str]:
    """Return {file name: contents} of the generated modules, imports rewritten."""
    with tempfile.TemporaryDirectory(prefix="kvsplice-proto-") as tmp:
        out_dir = Path(tmp)
        _run_protoc(out_dir)
        generated: dict[str, str] = {}
        for proto in PROTO_FILES:
            stem = Path(proto).stem
            source_dir = out_dir / Path(proto).parent
            for suffix in GENERATED_SUFFIXES:
                name = stem + suffix
                generated[name] = _rewrite_imports((source_dir / name).read_text())
        return generated


def _stale_files(generated: dict[str, str]) -> list[str]:
    stale = []
    for name, text in generated.items():
        committed = PROTO_DIR / name
        if not committed.exists() or committed.read_text() != text:
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args(argv)
    generated = generate()
    if args.check:
        stale = _stale_files(generated)
        if stale:
            print(
                f"generated code is stale: {', '.join(stale)} differ from {', '.join(PROTO_FILES)}; "
                "run `python scripts/gen_proto.py` and commit the result",
                file=sys.stderr,
            )
            return 1
        print(f"generated code matches {', '.join(PROTO_FILES)}")
        return 0
    for name, text in generated.items():
        (PROTO_DIR / name).write_text(text)
    print(f"wrote {', '.join(sorted(generated))} to {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
