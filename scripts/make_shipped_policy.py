"""Write the admission policy the package ships for a packaged model (common/shipped_policies/).

It is `kvsplice calibrate`'s judge probes alone, on the shipped judge sample (or DATA, a
`bench judge --data` file: every set in it) × SEEDS shuffled orders (no execution-agent
probes: the shipped policy admits no approximate mode for ordinary calls, which then run
`exact`): what the probes admit for judges, with its guard margins and its held-out JCR,
and the judge routes' cost model timed here (the risk gate prices routes with it). Run
(model: a packaged name, default SmolLM2; its own dtype, as `--dtype auto` loads it):
    .venv/bin/python scripts/make_shipped_policy.py [MODEL [SEEDS [THREADS [DATA [VARIANT]]]]]
THREADS (torch's thread count, default 1) should not exceed the idle cores; VARIANT: the
parameters every judge candidate sets (`CalibrationConfig.judge_variant`, e.g. `q=1`).
Qwen's policy: `qwen2.5-coder-0.5b 2 2 eval/data/judge_probes_qwen_humaneval.jsonl q=1`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from kvsplice.client.model.models import ModelConfig, load_model
from kvsplice.client.model.packaged_models import PACKAGED_MODELS
from kvsplice.client.modes.admission import save_policy
from kvsplice.common.reuse_modes import SHIPPED_DIR
from kvsplice.eval.measure.calibrate import (
    CalibrationConfig,
    render_judge_probes,
    run_calibration,
)
from kvsplice.eval.workloads.judge_examples import load_judge_data


def main() -> None:
    console = Console()
    name = sys.argv[1] if len(sys.argv) > 1 else ModelConfig().source
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    loaded = load_model(ModelConfig(source=name, dtype=PACKAGED_MODELS[name].dtype))
    config = CalibrationConfig(modes=(), judge_seeds=tuple(range(seeds)))
    if len(sys.argv) > 4:
        data = Path(sys.argv[4])
        config = replace(config, judge_data=data, judge_probes=len(load_judge_data(data)))
    if len(sys.argv) > 5:
        config = replace(config, judge_variant=sys.argv[5])
    result = run_calibration(config, progress=console.log, loaded=loaded)
    console.print(render_judge_probes(result))
    policy = replace(result.policy, created_at=result.policy.created_at)
    path = SHIPPED_DIR / f"{loaded.fingerprint}.json"
    SHIPPED_DIR.mkdir(exist_ok=True)
    save_policy(policy, path)
    console.print(f"{path}: admitted {policy.admitted_modes}, for judges {policy.judge_modes}")


if __name__ == "__main__":
    main()
