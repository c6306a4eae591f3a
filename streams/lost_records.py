"""Records a partition no longer holds: which offsets of a read were deleted before the worker got to them.

Why: a topic whose retention is shorter than a stalled worker's delay (or ``kafka-delete-records``) moves
the partition's log start past offsets never processed. The consumer then resets without a word, and a
catch-up read of those offsets returns nothing forever. ``FetchedRange`` carries the log start measured
after the read, so ``lost_ranges`` can tell a deleted offset (below the log start, not returned) from an
offset that never held a record the agent sees (a transaction marker, at or past the log start).

Contract: ``lost_ranges(start, end, fetched)`` is the offsets in ``[start, min(end, log_start))`` not among
``fetched.records``, as ``(first, count)`` runs in order; empty when nothing was deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_bus.streams.turn_record import TurnRecord


@dataclass(frozen=True)
class FetchedRange:
    """What a read of ``[start, end)`` found, and where the partition's log started once it was read."""

    records: list[TurnRecord] = field(default_factory=list)
    log_start: int = 0


def lost_ranges(start: int, end: int, fetched: FetchedRange) -> list[tuple[int, int]]:
    """``(first offset, count)`` of each run of deleted offsets in ``[start, end)``."""
    gone_below = min(end, fetched.log_start)
    present = sorted({r.offset for r in fetched.records if start <= r.offset < gone_below})
    runs, cursor = [], start
    for offset in present + [gone_below]:
        if offset > cursor:
            runs.append((cursor, offset - cursor))
        cursor = offset + 1
    return runs
