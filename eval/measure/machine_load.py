"""How busy the machine was: the load average beside the cores, and a warning when it exceeds them.

Owns `load_average`, `busy_machine_warning` and `warn_if_busy` only (no torch: the store bench uses
them too). Every bench records these facts beside its timings and logs the
warning, because a ratio measured while other processes took the cores is noise.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages now."""
    return [round(x, 2) for x in os.getloadavg()]


def busy_machine_warning(load: list[float] | tuple[float, ...], num_cpus: int) -> str | None:
    """One sentence when the 1- or 5-minute load average exceeds the cores, else None."""
    busiest = max(load[:2])
    if busiest <= num_cpus:
        return None
    return (
        f"load average {busiest:.1f} exceeds the {num_cpus} CPU cores: other processes "
        "shared the cores, so timings and speedups are noisy (rerun on an idle machine)"
    )


def warn_if_busy() -> str | None:
    """Log (and return) `busy_machine_warning` for the load now."""
    warning = busy_machine_warning(load_average(), os.cpu_count() or 1)
    if warning is not None:
        logger.warning("%s", warning)
    return warning
