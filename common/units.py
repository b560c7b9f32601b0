"""How sizes read to a person: byte counts in IEC units (what tables and pages print)."""

from __future__ import annotations


def human_bytes(num_bytes: int | float) -> str:
    """1536 -> '1.5 KiB' (IEC units, one decimal past bytes)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
