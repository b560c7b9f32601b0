"""`VllmBenchConfig`, the flags of `kvsplice bench vllm` beside its fields. Imports neither torch
nor vLLM: the CLI derives `--help` from it; running it is `bench`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsplice.common.config_flags import flag
from kvsplice.common.reuse_modes import ANCHOR, GATED

DEFAULT_CONFIGS = (
    "recompute", "example-connector", "lmcache", "kvsplice", "kvsplice-grpc",
    "kvsplice-restarted", "local-apc",
)  # fmt: skip
# kvsplice-gated: every request opts into approximate reuse, on engines whose admission
# policy admits it (the bench writes one admitting naive for the served model).
# control-unrotated, control-noise: the same, on engines whose approximate runs are
# deliberately damaged (the graded yardstick's negative controls, `negative_controls`).
# kvsplice-anchor: every request asks for the anchor mode (KVComm's correction at load).
CONTROLS = {"control-unrotated": "unrotated", "control-noise": "noise"}
# configurations whose requests ask for approximate reuse, and the mode each asks for
REQUESTED_REUSE = {"kvsplice-gated": GATED, "kvsplice-anchor": ANCHOR} | {
    name: GATED for name in CONTROLS
}
APPROXIMATE = tuple(REQUESTED_REUSE)
CONFIGS = (*DEFAULT_CONFIGS, *APPROXIMATE)
# test problems per workload (`graded_pipelines`): --problems index into these
WORKLOAD_SIZES = {"humaneval": 164, "mmlu": 14_042, "gsm8k": 1_319}
LAYOUTS = ("transcript", "persona-first")
DTYPES = ("float32", "bfloat16", "float16")
PREFIX_CACHING = {"on": True, "off": False}


@dataclass(frozen=True)
class VllmBenchConfig:
    """The 5-agent pipeline through `configs` (each with vLLM's prefix cache per
    `prefix_caching` where a connector runs), `repeats` times; `model_dir` is vLLM's --model."""

    out_json: Path | None = flag(  # noqa: RUF009 (`flag` makes a field, as `field` does)
        None, "Write the results JSON here (required).", name="json", path=True
    )
    configs: tuple[str, ...] = flag(
        DEFAULT_CONFIGS,
        "Comma-separated configurations: recompute, example-connector, lmcache, kvsplice, "
        "kvsplice-grpc, kvsplice-restarted, local-apc, kvsplice-gated (every request asks "
        "for approximate reuse; the engines' policy admits naive, then anchor), "
        "kvsplice-anchor (every request asks for the anchor mode: naive's K/V corrected by "
        "stored anchors, KVComm's gate falling back to exact), control-unrotated and "
        "control-noise (the same with approximate K/V deliberately damaged: keys left "
        "unmoved, or noise at 25% of each layer's RMS). recompute comes first.",
        csv=True,
    )
    layout: str = flag(
        "transcript",
        "transcript: each agent's prompt extends the previous one (exact reuse covers it); "
        "persona-first: each agent under its own system prompt, then the shared context and "
        "the earlier answers quoted (one un-measured run on another problem first, so each "
        "persona has been seen, as in a pipeline that has run before).",
        choices=LAYOUTS,
    )
    answer_tokens: int = flag(128, "Tokens each agent generates (min = max).", min=16, max=1024)
    problem_index: int = flag(
        129, "HumanEval problem index (129: the longest).", name="problem", min=0, max=163
    )
    workload: str = flag(
        "humaneval",
        "What --problems grades: humaneval (code run against the tests; the judge's PASS/FAIL "
        "against the reviser's result), mmlu (letters; the judge picks between the solver's "
        "and the reviser's answers) or gsm8k (final numbers; the judge likewise).",
        choices=tuple(WORKLOAD_SIZES),
    )
    problems: tuple[int, ...] = flag(
        (),
        "Problem indices into --workload's test split to grade (comma-separated; MMLU: the "
        "order of its test records, ids mmlu-test-<index>): after its timed repeats each "
        "configuration runs the pipeline once per problem (answers end at the end of turn or "
        "--answer-tokens).",
        csv=True, min=0, max=14_041,
    )  # fmt: skip
    concurrency: int = flag(
        1,
        "Graded pipelines in flight at once (--problems): each problem's five agents run in "
        "order, up to this many problems beside each other, so the engines batch their "
        "requests as under load; results stay in --problems order.",
        min=1, max=64,
    )  # fmt: skip
    threads: str = flag("0-1", "CPU cores every engine is pinned to (VLLM_CPU_OMP_THREADS_BIND).")
    # float32 by default: in bfloat16 a prompt prefilled in two parts (loaded prefix +
    # computed rest) rounds differently from one pass, so greedy outputs can part after
    # ~100 tokens for every KV-sharing setup alike (vLLM's own prefix cache included).
    dtype: str = flag(
        "float32",
        "Engine dtype. In bfloat16 a prefix loaded from anywhere (vLLM's own prefix cache "
        "too) rounds unlike one-pass prefill, so greedy outputs can part late in an answer.",
        choices=DTYPES,
    )
    repeats: int = flag(
        3, "Timed pipeline runs per configuration (median, spread); 0: none, only the graded "
        "runs of --problems.", min=0, max=20,
    )  # fmt: skip
    prefix_caching: tuple[str, ...] = flag(
        ("on", "off"),
        "vLLM's prefix cache for the connector configurations: on, off or on,off (recompute "
        "always runs without it, local-apc with it).",
        csv=True,
    )
    save_decode: bool = flag(
        True, "kvsplice and LMCache both store decode-written K/V (--no-save-decode: neither)."
    )
    chunk_tokens: int = flag(
        256,
        "Tokens per stored chunk, kvsplice's and LMCache's alike: a multiple of the engines' "
        "KV block size (vLLM's CPU backend: 128), or the connector refuses to start.",
        min=16,
    )
    save_tails: bool = flag(
        True,
        "kvsplice also stores a request's last half chunk (--no-save-tails: whole chunks "
        "only, as LMCache's multi-process mode stores them).",
    )
    load_async: str = flag(
        "auto",
        "kvsplice's load_async: auto (beside the steps while other requests run), always, never.",
        choices=("auto", "always", "never"),
    )
    reuse_policy: Path | None = flag(  # noqa: RUF009
        None,
        "kvsplice-gated's engines read this admission policy (`bench vllm-graded --admit` "
        "writes one; default: the bench writes one admitting naive, to measure it).",
        path=True,
    )
    work_dir: Path = flag(  # noqa: RUF009
        Path("results/bench-vllm"), "Sidecar data, connector storage and engine logs.", path=True
    )
    model_dir: str = ""

    def __post_init__(self) -> None:
        if self.out_json is None:
            raise ValueError("--json is required: where the results go")
        for name in ("out_json", "work_dir", "reuse_policy"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.reuse_policy is not None and not set(APPROXIMATE) & set(self.configs):
            raise ValueError("--reuse-policy is kvsplice-gated's: add it to --configs")
        if self.workload not in WORKLOAD_SIZES:
            raise ValueError(f"workload {self.workload!r} not in {tuple(WORKLOAD_SIZES)}")
        size = WORKLOAD_SIZES[self.workload]
        if any(not 0 <= p < size for p in self.problems):
            raise ValueError(f"problems {self.problems}: {self.workload} has {size} (0-{size - 1})")
        if self.workload != "humaneval" and self.repeats:
            raise ValueError(f"--workload {self.workload} grades --problems: set --repeats 0")
        unknown = set(self.configs) - set(CONFIGS)
        if unknown or not self.configs:
            raise ValueError(f"configs {sorted(unknown)} not in {CONFIGS}")
        if self.configs[0] != "recompute":
            raise ValueError(
                "configs must start with 'recompute' (output_match compares against it)"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} not in {LAYOUTS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not float32, bfloat16 or float16")
        if not 16 <= self.answer_tokens <= 1024:
            raise ValueError(f"answer_tokens {self.answer_tokens} not in [16, 1024]")
        if not 0 <= self.repeats <= 20 or not (self.repeats or self.problems):
            raise ValueError(f"repeats {self.repeats} not in [1, 20] (0 only with --problems)")
        apc = self.prefix_caching
        if not apc or set(apc) - set(PREFIX_CACHING) or len(set(apc)) != len(apc):
            raise ValueError(f"prefix_caching {apc}: on, off or on,off")
        if not 1 <= self.concurrency <= 64:
            raise ValueError(f"concurrency {self.concurrency} not in [1, 64]")
        if len(set(self.problems)) != len(self.problems):
            raise ValueError(f"problems {self.problems} repeat")
        if self.chunk_tokens < 16 or self.chunk_tokens % 16:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} is not a positive multiple of 16")

    def runs(self) -> list[tuple[str, bool]]:
        """(configuration, prefix caching) in run order: recompute first, off; local-apc on;
        each connector configuration once per `prefix_caching` setting."""
        connector = tuple(PREFIX_CACHING[a] for a in self.prefix_caching)
        return [
            (name, apc)
            for name in self.configs
            for apc in (
                (False,) if name == "recompute" else (True,) if name == "local-apc" else connector
            )
        ]
