"""Write the admission policy the package ships for SmolLM2-135M (client/modes/shipped/).

It is `kvsplice calibrate`'s judge probes alone, on the shipped judge sample × 4 shuffled
orders (no execution-agent probes: the shipped policy admits no approximate mode for
ordinary calls, which then run `exact`): what the probes admit for judges, with its
guard margins and its measured JCR. Run:
    .venv/bin/python scripts/make_shipped_policy.py
"""

from __future__ import annotations

from dataclasses import replace

import torch
from rich.console import Console

from kvsplice.client.model.models import ModelConfig, load_model
from kvsplice.client.modes.admission import SHIPPED_DIR, save_policy
from kvsplice.eval.measure.calibrate import (
    CalibrationConfig,
    render_judge_probes,
    run_calibration,
)


def main() -> None:
    torch.set_num_threads(1)
    console = Console()
    loaded = load_model(ModelConfig())
    config = CalibrationConfig(modes=(), judge_seeds=(0, 1, 2, 3))
    result = run_calibration(config, progress=console.log, loaded=loaded)
    console.print(render_judge_probes(result))
    policy = replace(result.policy, created_at=result.policy.created_at)
    path = SHIPPED_DIR / f"{loaded.fingerprint}.json"
    SHIPPED_DIR.mkdir(exist_ok=True)
    save_policy(policy, path)
    console.print(f"{path}: admitted {policy.admitted_modes}, for judges {policy.judge_modes}")


if __name__ == "__main__":
    main()
