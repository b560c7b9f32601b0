"""`BenchAgentsConfig`, the flags of `kvsplice bench agents` beside its fields, and the help the
bench commands share. Imports no torch: the CLI derives `--help` from it; running it is `bench`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvsplice.agents.layouts import DEFAULT_LAYOUT
from kvsplice.agents.roles import MAX_AGENTS, MIN_AGENTS
from kvsplice.client.model.model_config import ModelConfig
from kvsplice.common.config_flags import existing_file_flag, flag
from kvsplice.common.reuse_modes import DENSE, EXACT, NAIVE

if TYPE_CHECKING:
    from kvsplice.client.modes.admission import AdmissionPolicy
    from kvsplice.eval.bench.mode_runner import ModeRunConfig

WORKLOADS = ("synthetic", "humaneval", "math", "mc", "gsm8k", "mmlu")
# eval.bench.mode_runner.GRAPHS and kvmath.quant.QUANT_SCHEMES import torch; a test checks
# these stay equal to them.
GRAPHS = ("fully_connected", "chain")
QUANT_SCHEMES = ("none", "fp16", "int8")

WORKLOAD_HELP = (
    "Task set. humaneval: the real HumanEval problems (in file order), graded by running their "
    "tests; gsm8k / mmlu: the real test sets (`make eval-data`), a subset drawn by --seed; "
    "math / mc: the small shipped samples (or --data); synthetic: fixed-shape random text."
)
LAYOUT_HELP = (
    "Where personas, the shared context and answers go: persona-first (KVComm's: each agent's "
    "own system prompt first), shared-first (a common preamble, the question and earlier "
    "answers first, each role's instruction last) or transcript (one growing group "
    "conversation: an agent prefills only its own turn). Fidelity is measured against dense "
    "prefill of the same layout."
)
MODES_HELP = (
    "Comma-separated mode variants; dense is the baseline. A variant is a mode, optionally "
    "with parameters after ':' joined by '+': blend:r=0.43, halo:h=4+eps=0.05, "
    "anchor:gamma=0.5+tau=0.1+metric=key+r=0.15, multicut:cut=16. Each mode's parameters "
    "(names, ranges, defaults) are its `Params` in kvsplice.client.modes; a parameter the "
    "mode does not take is refused with that list."
)
STORE_MEMORY_HELP = (
    "Embedded store's memory (every variant's namespace shares it; when full, the least "
    "recently used segments and anchors go, and the run names each mode that lost any: its "
    "reuse is then understated). Every mode of the README's synthetic run stores ~3.4 GiB "
    "(11 modes); give it 8192."
)


@dataclass(frozen=True)
class BenchAgentsConfig:
    """One benchmark run. `prefix_len`/`input_len`/`response_len` shape the synthetic
    workload only (its responses are exactly `response_len` tokens); the task
    workloads cap each agent at `max_new_tokens`. `store_target` None runs an
    embedded memory-only store of `store_memory_mib`. `data_path` replaces the shipped sample for math/mc (a
    GSM8K/MMLU-format JSONL); gsm8k/mmlu are the real test sets, a subset drawn by
    `seed` (which also draws the synthetic text). `modes` are variant specs (`mode_variants`), kept as
    their labels, dense first. `admission`: the base parameters of every variant
    (None: the defaults); `policy_path`: the file it was loaded from, recorded only.
    See `ModeRunConfig` for `quant` and `reference`. The CLI's `--layout` takes several
    layouts, one run each (`run_bench_layouts`).
    """

    workload: str = flag("synthetic", WORKLOAD_HELP, choices=WORKLOADS)
    num_agents: int = flag(
        3, "Agents per graph.", name="agents", cli_default=5, min=MIN_AGENTS, max=MAX_AGENTS
    )
    modes: tuple[str, ...] = flag((DENSE, EXACT, NAIVE), MODES_HELP, csv=True)
    policy_path: Path | None = existing_file_flag(  # noqa: RUF009 (it makes a field)
        "Admission policy JSON (kvsplice calibrate) for this model: the base parameters of "
        "every variant (default: built-in defaults). Nothing is gated on it.",
        name="policy",
    )
    samples: int = flag(3, "Tasks per variant.", min=1)
    seed: int = flag(0, "Draws the gsm8k/mmlu subset and the synthetic text.")
    graph: str = flag("fully_connected", "Agent graph.", choices=GRAPHS)
    layout: str = flag(
        DEFAULT_LAYOUT,
        LAYOUT_HELP + " Several, comma-separated, run one after another on the same problems "
        "and write layouts.md / layouts.json beside their results.",
    )
    max_new_tokens: int = flag(64, "Tokens each agent generates.", min=1)
    prefix_len: int = flag(512, "synthetic: system prompt tokens", min=1)
    input_len: int = flag(256, "synthetic: user input tokens", min=1)
    response_len: int = flag(128, "synthetic: tokens per response", min=1)
    quant: str = flag("none", "Payload encoding in the store.", choices=QUANT_SCHEMES)
    data_path: Path | None = existing_file_flag(  # noqa: RUF009
        "GSM8K/MMLU-format JSONL for math/mc.",
        name="data",
    )
    out_dir: Path = flag(  # noqa: RUF009
        Path("results/bench_agents"), "Where results.json, .md and plots go.", name="out", path=True
    )
    store_memory_mib: int = flag(2048, STORE_MEMORY_HELP, min=1)
    store_target: str | None = None
    store_token: str | None = None
    reference: str = "full"
    warmup: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    admission: AdmissionPolicy | None = None

    def __post_init__(self) -> None:
        from kvsplice.eval.workloads.synthetic import SyntheticConfig  # imports torch

        if self.workload not in WORKLOADS:
            raise ValueError(f"workload {self.workload!r} not in {WORKLOADS}")
        if not MIN_AGENTS <= self.num_agents <= MAX_AGENTS:
            raise ValueError(f"num_agents {self.num_agents} outside [{MIN_AGENTS}, {MAX_AGENTS}]")
        if self.store_memory_mib < 1:
            raise ValueError(f"store_memory_mib {self.store_memory_mib} must be >= 1")
        if self.samples < 1:
            raise ValueError(f"samples {self.samples} must be >= 1")
        if self.data_path is not None and self.workload not in ("math", "mc"):
            raise ValueError(f"data_path is for the math and mc workloads, not {self.workload!r}")
        if self.policy_path is not None and self.admission is None:
            raise ValueError(f"policy_path {self.policy_path} names no loaded admission policy")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        for name in ("data_path", "policy_path"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        SyntheticConfig(self.prefix_len, self.input_len, self.response_len, self.seed)
        # validates modes, graph, quant, reference; modes become labels, dense first
        object.__setattr__(self, "modes", self.mode_run_config("check").modes)

    def mode_run_config(self, run_id: str) -> ModeRunConfig:
        from kvsplice.eval.bench.mode_runner import ModeRunConfig  # imports torch

        return ModeRunConfig(
            modes=self.modes, num_agents=self.num_agents, graph=self.graph, layout=self.layout,
            max_new_tokens=self.max_new_tokens, quant=self.quant, reference=self.reference,
            warmup=self.warmup, namespace=f"bench-{self.workload}-{run_id}",
            store_token=self.store_token, admission=self.admission,
        )  # fmt: skip
