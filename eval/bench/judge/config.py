"""`BenchJudgeConfig` and the flags of `kvsplice bench judge` beside its fields. Imports no torch:
the CLI derives `--help` from it; running it is `bench`'s.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvsplice.agents.judge import JUDGE_LAYOUTS, REGIMES
from kvsplice.agents.judge_prompts import TASKS
from kvsplice.client.model.model_config import ModelConfig
from kvsplice.common.config_flags import existing_file_flag, flag
from kvsplice.eval.bench.agents.config import MODES_HELP

if TYPE_CHECKING:
    from kvsplice.client.modes.admission import AdmissionPolicy
    from kvsplice.eval.bench.judge.runner import JudgeRunConfig

# A HumanEval candidate is a whole function: 48 tokens cut most of them before the tests can pass.
TASK_MAX_NEW_TOKENS = {"humaneval": 160}
DEFAULT_MAX_NEW_TOKENS = 48


def default_judge_modes() -> tuple[str, ...]:
    """Every registered mode (the risk gate's "gated" among them when this build has it)."""
    from kvsplice.client.modes.registry import MODES  # imports torch

    return tuple(MODES)


def default_max_new_tokens(task: str | None) -> int:
    """Tokens each execution agent may generate on `task` when not told."""
    return TASK_MAX_NEW_TOKENS.get(task or "", DEFAULT_MAX_NEW_TOKENS)


@dataclass(frozen=True)
class BenchJudgeConfig:
    """One judge bench. `task` None: gsm8k, or with `data_path` every task in the file
    (a task given with `data_path` keeps only its examples). `examples`: how many
    (the first ones). See `JudgeRunConfig` for the run's fields. `diagnostics`:
    attention from the decision position per layer, dense vs each mode.
    """

    task: str | None = flag(
        None,
        "Task format of the judge prompt and of the questions (default gsm8k; with --data: "
        "every task in the file, or only this one).",
        choices=TASKS,
    )
    regime: str = flag(
        "progressive",
        "How the execution agents produce the candidates: progressive (agent i sees the "
        "answers of agents before it) or parallel (independent).",
        choices=REGIMES,
    )
    layout: str = flag(
        "transcript",
        "transcript: one group conversation, the agents speaking in display order and the "
        "judge last, so a progressive agent's answer is in the judge prompt's exact chain (how "
        "a pipeline on kvsplice lays its judge out); persona-first: each agent under its own "
        "system prompt, the judge quoting the answers in a prompt of its own (no candidate in "
        "an exact chain: seed 001's setting).",
        choices=JUDGE_LAYOUTS,
    )
    num_candidates: int = flag(4, "Execution agents (candidates).", name="candidates", min=2, max=8)
    shuffle: bool = flag(
        True,
        "Shuffle the candidates' display order per example (seeded); the dense and the reuse "
        "judge of an example see the same order.",
    )
    modes: tuple[str, ...] = flag(
        MISSING,
        MODES_HELP + " 'gated' is the admission policy with the risk gate above it, as a worker "
        "runs it. Default: every mode.",
        default_factory=default_judge_modes, csv=True, cli_default=None,
    )  # fmt: skip
    seed: int = flag(0, "Seed of the per-example permutations.")
    policy_path: Path | None = existing_file_flag(  # noqa: RUF009 (it makes a field)
        "Admission policy JSON for this model: what 'gated' runs and the base parameters of "
        "every variant (default: the policy shipped for the model, SmolLM2-135M's, else the "
        "built-in safe one).",
        name="policy",
    )
    json_path: Path | None = flag(  # noqa: RUF009
        None, 'Also write the result here: {"modes": [...], ...}.', name="json", path=True
    )
    data_path: Path | None = existing_file_flag(  # noqa: RUF009
        "JSONL of candidate sets to judge instead of generating them: one "
        '{"id", "task", "question", "candidates": [2-8 strings], "answer"?} per line.',
        name="data",
    )
    examples: int = flag(8, "Examples judged (the first ones).", min=1)
    max_new_tokens: int = flag(
        DEFAULT_MAX_NEW_TOKENS,
        "Tokens each execution agent may generate (default: 160 for humaneval, whose "
        "candidates are whole functions graded by their tests; 48 otherwise).",
        cli_default=None, min=1,
    )  # fmt: skip
    temperature: float = flag(
        0.0,
        "Sample the execution agents' candidates at this temperature (best-of-N: each draw "
        "seeded by --seed, the example and the agent); 0 decodes greedily.",
        min=0,
    )  # fmt: skip
    diagnostics: bool = flag(True, "Attention diagnostics per layer (one more forward per call).")
    out_dir: Path = flag(  # noqa: RUF009
        Path("results/bench_judge"), "Where results.json, .md and plots go.", name="out", path=True
    )
    judge_max_new_tokens: int = 6
    store_target: str | None = None
    store_token: str | None = None
    store_memory_mib: int = 2048
    warmup: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    admission: AdmissionPolicy | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task {self.task!r} not in {TASKS}")
        if self.examples < 1:
            raise ValueError(f"examples {self.examples} must be >= 1")
        if self.store_memory_mib < 1:
            raise ValueError(f"store_memory_mib {self.store_memory_mib} must be >= 1")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        for name in ("json_path", "data_path", "policy_path"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        object.__setattr__(self, "modes", self.run_config("check").modes)

    def run_config(self, run_id: str) -> JudgeRunConfig:
        from kvsplice.eval.bench.judge.runner import JudgeRunConfig  # imports torch

        return JudgeRunConfig(
            modes=self.modes, regime=self.regime, num_candidates=self.num_candidates,
            shuffle=self.shuffle, seed=self.seed, layout=self.layout,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            judge_max_new_tokens=self.judge_max_new_tokens, warmup=self.warmup,
            namespace=f"judge-{run_id}", store_token=self.store_token, admission=self.admission,
        )  # fmt: skip
