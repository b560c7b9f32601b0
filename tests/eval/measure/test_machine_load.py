"""The busy-machine warning: said when the 1- or 5-minute load exceeds the cores, not otherwise."""

from __future__ import annotations

import pytest

from kvsplice.eval.measure import machine_load
from kvsplice.eval.measure.machine_load import busy_machine_warning, load_average


@pytest.mark.parametrize(
    ("load", "num_cpus", "warned"),
    [
        ((1.9, 2.0, 9.0), 2, False),  # the 15-minute figure is history, not this run
        ((2.1, 1.0, 0.5), 2, True),
        ((0.5, 4.5, 4.5), 4, True),
        ((15.0, 15.0, 15.0), 16, False),
    ],
)
def test_warns_only_above_the_cores(load: tuple[float, ...], num_cpus: int, warned: bool) -> None:
    warning = busy_machine_warning(load, num_cpus)
    assert (warning is not None) == warned
    if warning is not None:
        assert f"{max(load[:2]):.1f} exceeds the {num_cpus} CPU cores" in warning


def test_warn_if_busy_logs_the_sentence(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(machine_load.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)
    assert load_average() == [9.0, 9.0, 9.0]
    with caplog.at_level("WARNING"):
        warning = machine_load.warn_if_busy()
    assert warning is not None and warning in caplog.text
