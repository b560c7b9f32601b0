"""`DemoConfig` and the flags of `kvsplice demo` beside its fields. Imports no torch: the CLI
derives `--help` from it; running it is `bench`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvsplice.agents.layouts import LAYOUTS
from kvsplice.client.model.model_config import ModelConfig
from kvsplice.common.config_flags import existing_file_flag, flag
from kvsplice.common.reuse_modes import DENSE, EXACT, GATED, NAIVE
from kvsplice.eval.bench.agents.config import LAYOUT_HELP, MODES_HELP

if TYPE_CHECKING:
    from kvsplice.client.modes.admission import AdmissionPolicy
    from kvsplice.eval.bench.mode_runner import ModeRunConfig

NUM_AGENTS = 5
NUM_HUMANEVAL_PROBLEMS = 164


@dataclass(frozen=True)
class DemoConfig:
    """The demo's knobs; `max_new_tokens` per agent keeps it within minutes on a CPU.

    `layout` defaults to `transcript`, the layout that makes `exact` pay;
    `persona-first` reproduces KVComm's prompts (and the demo before layouts).
    `judge`: end with a judge over each problem's answers (dense, naive and `gated`
    vs the dense judge) and show the risk gate's routes. `policy_path`: the admission
    policy `gated` runs (None: the one shipped for the model, else the safe default).
    """

    num_problems: int = flag(
        3, "HumanEval problems.", name="problems", min=1, max=NUM_HUMANEVAL_PROBLEMS
    )
    modes: tuple[str, ...] = flag(
        (DENSE, EXACT, NAIVE, GATED),
        MODES_HELP + " Default: dense, exact, what --policy admits, then naive.",
        csv=True, cli_default=None,
    )  # fmt: skip
    layout: str = flag("transcript", LAYOUT_HELP, choices=LAYOUTS)
    policy_path: Path | None = existing_file_flag(  # noqa: RUF009 (it makes a field)
        "Admission policy JSON (kvsplice calibrate): its admitted modes join the default "
        "--modes, and 'gated' (the policy with the judge risk gate above it, in the pipeline "
        "and in the closing judge stage) runs it. Default: the policy shipped for the model "
        "(SmolLM2-135M), else only exact and dense.",
        name="policy",
    )
    max_new_tokens: int = flag(32, "Tokens each agent generates.", min=1)
    out_dir: Path = flag(  # noqa: RUF009
        Path("results/demo"), "Where demo.json and the TTFT chart go (created).",
        name="out", path=True,
    )  # fmt: skip
    store_target: str | None = None
    store_token: str | None = None
    graph: str = "fully_connected"
    quant: str = "none"
    keep_store: bool = False
    warmup: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    judge: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.num_problems <= NUM_HUMANEVAL_PROBLEMS:
            raise ValueError(f"num_problems {self.num_problems} outside [1, 164] (HumanEval)")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.policy_path is not None:
            object.__setattr__(self, "policy_path", Path(self.policy_path))
        self.mode_run_config("check")

    def mode_run_config(
        self, run_id: str, admission: AdmissionPolicy | None = None
    ) -> ModeRunConfig:
        from kvsplice.eval.bench.mode_runner import ModeRunConfig  # imports torch

        return ModeRunConfig(
            modes=self.modes, num_agents=NUM_AGENTS, graph=self.graph, layout=self.layout,
            max_new_tokens=self.max_new_tokens, quant=self.quant, warmup=self.warmup,
            namespace=f"demo-{run_id}", store_token=self.store_token, admission=admission,
        )  # fmt: skip
