"""End-of-run markers that were deleted with the records around them: when the run is over anyway.

Why: the writer closes a run on its end-of-run markers (``rollout_bus.consumers.shard_writer.end_of_run``).
When retention (or ``kafka-delete-records``) took a partition's markers along with its episodes, the writer
has already named the range as lost (``episodes_reader``), and waiting for a marker inside that range is
waiting forever. So the end of the run is decided from what the log can still deliver: once every marker
still owed could only have been in a range known to be lost, and the writer has read every partition up to
its end offset (positions, never a clock), nothing more of the run can come.

Contract:

* ``LostRange(topic, partition, first, count)``: offsets ``first..first+count-1`` deleted unread;
  ``describe()`` says it as the ``LOST`` line does (``<topic> partition P: offsets A..B (N records)``).
* ``runs_ended_by_loss(partitions, lost, last_member, unfinished)`` is the decision, before the caught-up
  check (the caller's: end offsets against positions). ``unfinished`` is every run with a marker seen and
  the markers it still misses per episodes partition (``EndOfRunTracker.unfinished``); ``last_member``
  the offset of the last record read on each partition that is not a marker. It returns ``None`` (wait)
  unless records were lost and:

  - some run is unfinished: every episodes partition owing one of its markers had a lost range (a
    partition with no loss still gets its marker). Each such run is returned, to be ended;
  - no run is known (every marker was lost): every partition had a lost range and none has delivered an
    episode or abandoned record after its last one: a partition whose markers were all deleted holds
    nothing of that run past them, while a run still being written leaves episodes at the tail.
    ``[]`` is returned: end the run, whose name no record gives any more.

  A run still being written looks like this only in corners (a turns partition that finished early left
  the only surviving markers, or all it wrote so far was deleted and the writer caught up before its next
  episode): the verdict is loud (``RecordsLostError``), never a silent end.
  ``describe_owed(unfinished)`` says which markers were still owed, for the ERROR line.
* ``RecordsLostError(ranges)``: the run ended with records lost; its message names every range (topic,
  partition, offsets, count) on one line, beginning ``LOST_VERDICT``. ``rollout-bus shards`` exits
  ``EXIT_RECORDS_LOST`` (65, EX_DATAERR) with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rollout_bus.errors import RolloutBusError

__all__ = ["EXIT_RECORDS_LOST", "LOST_VERDICT", "LostRange", "RecordsLostError", "describe_owed",
           "runs_ended_by_loss"]

EXIT_RECORDS_LOST = 65  # EX_DATAERR: the run ended, with records deleted before they were read
LOST_VERDICT = "run ended with records lost"  # how the verdict line begins (the demo finds it in the log)


@dataclass(frozen=True)
class LostRange:
    """Offsets of one partition deleted before the writer read them."""

    topic: str
    partition: int
    first: int
    count: int

    @property
    def end(self) -> int:
        """The first offset past the range."""
        return self.first + self.count

    def describe(self) -> str:
        return f"{self.topic} partition {self.partition}: offsets {self.first}..{self.end - 1} ({self.count} records)"


class RecordsLostError(RolloutBusError):
    """The run ended with records deleted unread: every lost range named, on one line."""

    def __init__(self, ranges: Sequence[LostRange]) -> None:
        self.ranges = list(ranges)
        total = sum(r.count for r in self.ranges)
        super().__init__(f"{LOST_VERDICT}: {len(self.ranges)} ranges, {total} records deleted before "
                         f"the shard writer read them (end-of-run markers among them may be): "
                         + "; ".join(r.describe() for r in self.ranges))


def runs_ended_by_loss(partitions: Iterable[int], lost: Sequence[LostRange], last_member: Mapping[int, int],
                       unfinished: Mapping[str, Mapping[int, Sequence[int]]]) -> list[str] | None:
    """The runs to end because their missing markers can only have been lost; None: wait (module docstring)."""
    lost_on = {r.partition for r in lost}
    if not lost_on:
        return None
    if unfinished:
        if all(set(missing) <= lost_on for missing in unfinished.values()):
            return sorted(unfinished)
        return None
    last_loss: dict[int, int] = {}
    for r in lost:
        last_loss[r.partition] = max(last_loss.get(r.partition, 0), r.end)
    if set(partitions) <= lost_on and all(last_member.get(p, -1) < end for p, end in last_loss.items()):
        return []
    return None


def describe_owed(unfinished: Mapping[str, Mapping[int, Sequence[int]]]) -> str:
    """The writer's ERROR line when it ends a run for loss: which markers it stops waiting for, and why."""
    owed = ("; ".join(f"run={run} episodes partition {p}: turns partitions {list(ts)}"
                      for run, missing in unfinished.items() for p, ts in missing.items())
            or "every marker of the run: none was read")
    return (f"end-of-run markers still owed ({owed}) can only have been among the lost records, and every "
            "partition is read to its end offset: ending the run")
