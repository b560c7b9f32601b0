"""Run the import contracts on the package as it is installed, those between rooms derived.

import-linter walks the `kvsplice` package directory, but our subpackages are mapped from
top-level folders (setuptools package-dir), so an editable install hides them from it. This
script lays the mapped tree out in a temp dir (copies of the .py files) and runs
`lint-imports` with that dir first on sys.path.

No contract between rooms is written by hand: they derive from pyproject's `packages` (a
room is a top-level package, `kvsplice.<room>`) and `[tool.kvsplice.rooms]`:
- the floors: a room imports only rooms on lower floors, the rooms of one floor are
  independent; a package on no floor is refused, so a new room must be placed;
- the torch-free rooms import neither torch, transformers nor a room that is not torch-free;
- the engines import below their floor only the rooms they may reach (the store client);
- the reuse modes stand alone: a mode is a module of client/modes (or a folder of it) that
  declares `SPEC = ModeSpec(...)`; no mode may import another, directly or through other
  modules (what several modes share lives in client/modes/shared.py, which imports none).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODE_PACKAGE = "kvsplice.client.modes"
DECLARES_MODE = re.compile(r"^SPEC = ModeSpec\(", re.MULTILINE)

Config = Mapping[str, Any]


def read_config(root: Path = ROOT) -> Config:
    return tomllib.loads((root / "pyproject.toml").read_text())


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    mapping = read_config(root)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def lay_out(target: Path, root: Path = ROOT) -> None:
    for name, folder in package_dirs(root).items():
        destination = target.joinpath(*name.split("."))
        destination.mkdir(parents=True, exist_ok=True)
        for source in folder.rglob("*.py"):
            relative = source.relative_to(folder)
            (destination / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / relative)


def rooms(config: Config) -> dict[str, list[str]]:
    """Each room (top-level package) and the packages in it, itself first."""
    found: dict[str, list[str]] = {}
    for package in config["tool"]["setuptools"]["packages"]:
        parts = package.split(".")
        if len(parts) > 1:
            found.setdefault(parts[1], []).append(package)
    return {room: sorted(packages) for room, packages in sorted(found.items())}


def floors(config: Config) -> list[list[str]]:
    """The floors, top down; ValueError unless every room stands on exactly one."""
    placed = config["tool"]["kvsplice"]["rooms"]["floors"]
    names = [room for floor in placed for room in floor]
    doubled = sorted({room for room in names if names.count(room) > 1})
    unplaced = sorted(set(rooms(config)) - set(names))
    unknown = sorted(set(names) - set(rooms(config)))
    for problem, found in (("on no floor", unplaced), ("on two floors", doubled),
                           ("on a floor but not a package", unknown)):  # fmt: skip
        if found:
            raise ValueError(f"rooms {problem}: {', '.join(found)} (pyproject.toml "
                             "[tool.kvsplice.rooms] floors and [tool.setuptools] packages)")  # fmt: skip
    return placed


def _module(room: str) -> str:
    return f"kvsplice.{room}"


def _listed(names: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{name}"' for name in names) + "]"


def _contract(name: str, kind: str, **fields: Sequence[str] | str) -> str:
    lines = ["", "[[tool.importlinter.contracts]]", f'name = "{name}"', f'type = "{kind}"']
    for key, value in fields.items():
        lines.append(f"{key} = {value}" if isinstance(value, str) else f"{key} = {_listed(value)}")
    return "\n".join(lines) + "\n"


def room_contracts(config: Config) -> str:
    """The contracts between rooms, as import-linter TOML."""
    placed = floors(config)
    settings = config["tool"]["kvsplice"]["rooms"]
    all_rooms = list(rooms(config))
    floor_of = {room: depth for depth, floor in enumerate(placed) for room in floor}
    layers = [" | ".join(_module(room) for room in floor) for floor in placed]
    torch_free = settings["torch_free"]
    not_torch_free = [room for room in all_rooms if room not in torch_free]
    engines, reach = settings["engines"], settings["engines_reach"]
    lowest = min(floor_of[engine] for engine in engines)
    out_of_reach = [r for r in all_rooms if floor_of[r] > lowest and r not in reach]
    return (
        _contract("rooms point down: " + " -> ".join(" | ".join(f) for f in placed),
                  "layers", layers=layers)
        + _contract(f"{', '.join(torch_free)} never import torch or transformers",
                    "forbidden", source_modules=[_module(r) for r in torch_free],
                    forbidden_modules=["torch", "transformers", *map(_module, not_torch_free)])
        + _contract(f"the engines ({', '.join(engines)}) reach the sidecar through "
                    f"{reach[0]}, never {', '.join(out_of_reach)}",
                    "forbidden", source_modules=[_module(r) for r in engines],
                    forbidden_modules=[_module(r) for r in out_of_reach],
                    allow_indirect_imports='"True"')
    )  # fmt: skip


def mode_modules(root: Path = ROOT) -> list[str]:
    """The importable names of the reuse modes: modules (or folders) declaring a `SPEC`."""
    modes = root / "client" / "modes"
    found = set()
    for source in modes.rglob("*.py"):
        if DECLARES_MODE.search(source.read_text()):
            relative = source.relative_to(modes)
            top = relative.parts[0] if len(relative.parts) > 1 else relative.stem
            found.add(f"{MODE_PACKAGE}.{top}")
    return sorted(found)


def modes_contract(modes: list[str]) -> str:
    return _contract(
        "reuse modes stand alone: no mode imports another (shared code: modes.shared)",
        "independence",
        modules=modes,
    )


def contracts(root: Path = ROOT) -> str:
    """pyproject.toml with every derived contract added."""
    config = read_config(root)
    pyproject = (root / "pyproject.toml").read_text()
    return pyproject + room_contracts(config) + modes_contract(mode_modules(root))


def floor_map(config: Config) -> str:
    """Every package, floor by floor: what the derived contracts cover."""
    packages = rooms(config)
    lines = []
    for depth, floor in enumerate(floors(config), start=1):
        placed = [" ".join(packages[room]) for room in floor]
        lines.append(f"floor {depth}: " + " | ".join(placed))
    return "\n".join(lines)


def lint(tree: Path, config_text: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the laid-out `tree` with the contracts in `config_text`."""
    config = tree / "contracts.toml"
    config.write_text(config_text)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", str(config)]
    return subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)


def main() -> int:
    try:
        print(floor_map(read_config()))
        config_text = contracts()
    except ValueError as error:
        print(f"check_layers: {error}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvsplice-layers-") as tmp:
        lay_out(Path(tmp))
        result = lint(Path(tmp), config_text)
    print(result.stdout + result.stderr, end="")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
