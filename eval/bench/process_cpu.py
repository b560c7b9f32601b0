"""CPU time of a process group (a bench's engine, sidecar or LMCache server), from /proc.

A bench's children each start a session of their own (`Child.spawn`), so one process
group holds the child and every process it forks (vLLM's API server and its engine core).
`group_cpu_s` sums user and system time over the group's live processes; CPU time of a
process that exited between two readings is not seen (the benches' children live for the
whole configuration). Linux only: elsewhere None.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PROC = Path("/proc")


def group_cpu_s(pgid: int) -> float | None:
    """User + system CPU seconds of the live processes in group `pgid`; None without /proc."""
    if not PROC.is_dir():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while read
            continue
        # fields after the command (in parentheses, which may hold spaces): state is 3rd,
        # pgrp 5th, utime 14th and stime 15th of the whole line
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def groups_cpu_s(pgids: Mapping[str, int]) -> dict[str, float | None]:
    """`group_cpu_s` of each named group."""
    return {name: group_cpu_s(pgid) for name, pgid in pgids.items()}


def cpu_s_per_request(
    before: Mapping[str, float | None], after: Mapping[str, float | None], num_requests: int
) -> dict[str, float | None]:
    """Each group's CPU seconds between two readings, per request (None: not measured)."""
    out: dict[str, float | None] = {}
    for name, start in before.items():
        end = after.get(name)
        out[name] = None if start is None or end is None else (end - start) / max(1, num_requests)
    return out
