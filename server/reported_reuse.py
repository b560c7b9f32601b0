"""What workers reported per namespace (`ReportReuse`): calls, prompt tokens, reused tokens by
where they were served and how many were approximate, kept with the tiers
(`storage.counter_records`) so that a restart on the same LMDB shows the same counts.

Owns the totals and when they are written (`persist`: on the server's cadence and at
shutdown); segment reads are the segment service's. Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from kvsplice.common.errors import KvspliceError
from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.common.reuse_report import SERVED, ReuseReport
from kvsplice.storage.counter_records import CounterRecords

logger = logging.getLogger(__name__)
_refusals = RateLimitedLog(logger, interval_s=300.0)

_HIT_PREFIX = "hit_tokens."


def report_counts(report: ReuseReport) -> dict[str, int]:
    """`report`'s token totals as named counts (what the tiers keep)."""
    hit = {f"{_HIT_PREFIX}{served}": report.hit_tokens.get(served, 0) for served in SERVED}
    return {
        "num_calls": report.num_calls,
        "num_prompt_tokens": report.num_prompt_tokens,
        "num_approximate_hit_tokens": report.num_approximate_hit_tokens,
        **hit,
    }


def report_of(counts: Mapping[str, int]) -> ReuseReport:
    """The totals `counts` name (names it does not know are ignored); ValueError if they
    do not add up."""
    return ReuseReport(
        counts.get("num_calls", 0),
        counts.get("num_prompt_tokens", 0),
        {served: counts.get(f"{_HIT_PREFIX}{served}", 0) for served in SERVED},
        num_approximate_hit_tokens=counts.get("num_approximate_hit_tokens", 0),
    )


class ReportedReuse:
    """Per-namespace totals of what workers reported, read from and written to `records`."""

    def __init__(self, records: CounterRecords) -> None:
        self._records = records
        self._totals: dict[str, ReuseReport] = {}
        self._changed: set[str] = set()  # namespaces whose totals the tiers do not hold yet

    def load(self) -> int:
        """Take the totals the tiers kept (at start, before any report); returns how many
        namespaces had some. A record whose counts do not add up is skipped (logged)."""
        for namespace, counts in self._records.load().items():
            try:
                self._totals[namespace] = report_of(counts)
            except ValueError as error:
                logger.warning("reported reuse of %s not restored: %s", namespace, error)
        if self._totals:
            logger.info("reported reuse restored for %d namespaces", len(self._totals))
        return len(self._totals)

    def add(self, namespace: str, report: ReuseReport) -> None:
        """Add `report`'s token totals (its segment reads are not kept here)."""
        self._totals[namespace] = self.of(namespace).merged(report.totals())
        self._changed.add(namespace)

    def of(self, namespace: str) -> ReuseReport:
        """The namespace's totals (zeros if it never reported)."""
        return self._totals.get(namespace) or ReuseReport()

    def namespaces(self) -> set[str]:
        return set(self._totals)

    async def persist(self) -> None:
        """Write the totals changed since the last write into the tiers (off the loop). A
        write the store refuses is logged and tried again next time."""
        changed, self._changed = self._changed, set()
        if not changed:
            return
        counts = {namespace: report_counts(self._totals[namespace]) for namespace in changed}
        try:
            await asyncio.to_thread(self._records.save, counts)
        except asyncio.CancelledError:
            # NOTE: the write goes on in its thread; marked again, the shutdown's write
            # replaces it after it ends (`CounterRecords` saves one at a time), before
            # the store closes.
            self._changed |= changed
            raise
        except KvspliceError as error:
            self._changed |= changed
            _refusals.log(
                "persist", logging.WARNING,
                "reported reuse not written to the tiers (tried again later): %s", error,
            )  # fmt: skip
