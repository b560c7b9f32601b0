"""Count the project modules one approximate `ReuseEngine` call passes through (issue 13's measure).

Builds a 4-layer random Llama over a character vocabulary, an embedded store,
and runs a two-agent chain per mode; the traced call is one that reuses
approximately (anchor: a near-duplicate question once the pool holds two;
other modes: the second agent of a chain). `sys.setprofile` records every
Python function entered on the calling thread; a module counts once. The engine runs
as a worker's does (`EngineConfig`'s defaults: segments put on its writer thread while
the next call runs, so the put path is not the call's); `--sync-puts` puts them on the
calling thread, inside the traced call.

    .venv/bin/python scripts/count_call_modules.py --modes anchor,blend [--sync-puts]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' character tokenizer and fake prompts
from helpers.client import make_tiny_llama  # noqa: E402
from helpers.text import CharTokenizer, FakePrompt, make_prompt  # noqa: E402


def project_folders() -> tuple[str, ...]:
    """Every top-level folder pyproject maps into the package (proto and integrations too)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return tuple(sorted({Path(folder).parts[0] for folder in mapping["package-dir"].values()}))


PROJECT_FOLDERS = project_folders()
SYSTEMS = ("You plan.", "You solve.")
QUESTIONS = ("what is two plus two?", "name a prime number above ten")
NEAR_DUPLICATE = "what is two plus two!"


def agent_prompt(agent: int, question: str, upstream: tuple[int, ...] | None) -> FakePrompt:
    system = f"<|im_start|>system\n{SYSTEMS[agent]}<|im_end|>\n<|im_start|>user\nProblem:\n"
    closing = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"
    parts: list[tuple[str, str, str | tuple[int, ...]]] = [
        ("text", "text_0", system),
        ("placeholder", "user_question", question),
    ]
    if upstream is not None:
        parts += [
            ("text", "text_2", "\nAgent 1 said:\n"),
            ("placeholder", "agent_1_current", upstream),
        ]
    return make_prompt([*parts, ("text", "text_9", closing)])


def project_module(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents:
        return None
    relative = path.relative_to(ROOT)
    if relative.parts[0] not in PROJECT_FOLDERS or relative.suffix != ".py":
        return None
    return ".".join(relative.with_suffix("").parts)


def traced(call) -> tuple[object, set[str]]:
    modules: set[str] = set()

    def profile(frame, event, _arg) -> None:
        if event == "call":
            name = project_module(frame.f_code.co_filename)
            if name is not None:
                modules.add(name)

    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return result, modules


def count_modules(mode: str, target: str, sync_puts: bool) -> tuple[set[str], int]:
    from kvsplice.client.execute.execution import GenerationConfig
    from kvsplice.client.model.models import bundle_model
    from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
    from kvsplice.storeclient.client import StoreClient

    loaded = bundle_model(make_tiny_llama(num_layers=4), CharTokenizer())
    store = StoreClient(target, f"count-{mode}")
    engine = ReuseEngine(loaded, mode, store, EngineConfig(quant="none", async_store=not sync_puts))
    generation = GenerationConfig(max_new_tokens=6, stop_token_ids=(127,))

    def chain(question: str, trace_agent: int | None):
        upstream, modules, outcome = None, set(), None
        for agent in (0, 1):
            prompt = agent_prompt(agent, question, upstream)
            if agent == trace_agent:
                outcome, modules = traced(lambda p=prompt: engine.run(p, generation))
            else:
                outcome = engine.run(prompt, generation)
            upstream = outcome.output_ids or (32,)
            engine.flush()  # the next call finds every put segment
        return modules, outcome

    for question in QUESTIONS:
        chain(question, None)
    question, agent = (NEAR_DUPLICATE, 0) if mode == "anchor" else (QUESTIONS[0] + " ", 1)
    modules, outcome = chain(question, agent)
    approximate = sum(s.num_tokens for s in outcome.reused if not s.exact)
    return modules, approximate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="anchor,blend")
    parser.add_argument("--list", action="store_true", help="print the modules too")
    parser.add_argument(
        "--sync-puts", action="store_true", help="put segments on the calling thread"
    )
    args = parser.parse_args()
    from kvsplice.server.embedded import EmbeddedStore, loopback_config

    torch.set_num_threads(1)
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedStore(loopback_config(f"{tmp}/lmdb")) as store,
    ):
        for mode in args.modes.split(","):
            modules, approximate = count_modules(mode, store.target, args.sync_puts)
            print(
                f"{mode}: {len(modules)} project modules (approximately reused tokens: {approximate})"
            )
            if args.list:
                print("  " + "\n  ".join(sorted(modules)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
