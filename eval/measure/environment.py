"""What a measurement ran on: library versions, CPU/GPU names, threads, load, model identity.

Owns `environment_info` only. Timings are ratios within one run; these facts
say which machine the ratios belong to and how busy it was.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import torch
import transformers

from kvsplice.client.model.models import LoadedModel
from kvsplice.eval.measure.machine_load import busy_machine_warning, load_average

logger = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")


def cpu_name() -> str:
    """The CPU model name (from /proc/cpuinfo on Linux, else `platform.processor()`)."""
    if CPUINFO.is_file():
        for line in CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def environment_info(loaded: LoadedModel) -> dict[str, object]:
    """JSON-ready facts about this process, machine and model; `load_average` is at the
    call (benches call it at the end: the 5- and 15-minute figures cover the run), and
    `busy_machine_warning` says when it exceeded the cores (else None)."""
    model = loaded.model
    load = load_average()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "load_average": load,
        "busy_machine_warning": busy_machine_warning(load, os.cpu_count() or 1),
        "gpu": gpu_name(),
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "model_type": model.config.model_type,
        "model_fingerprint": loaded.fingerprint,
    }
