"""When a run is over, as far as the shard writer can tell from rollout.episodes alone.

Contract:

* The stream stage forwards ``EndOfRun(run, turns_partition=p, turns_partitions=n)`` to every
  rollout.episodes partition after every episode (and abandoned record) of turns partition ``p``.
  ``EndOfRunTracker(partitions)`` is told the rollout.episodes partitions the writer reads;
  ``add(marker)`` returns True once, for a run id, every one of those partitions has carried the
  marker of every turns partition ``0..n-1``: nothing more of that run is coming, so the writer
  flushes what is pending as partial batches.
* Until then the markers are held (``held(run)``): the caller keeps their offsets uncommitted, so
  a writer that crashes before the flush is written reads them again after a restart and reaches
  the same decision. After ``finished(run)`` the run's markers are released by the caller, and a
  later copy of one (a replay) is ``add``-ed as a no-op returning False (``is_finished``).
* Duplicates are harmless: the same (run, turns partition, episodes partition) seen twice counts
  once (both copies are held and released together). Markers of one run that disagree on
  ``turns_partitions`` are completed against the largest ``n`` seen, with a warning.
* ``unfinished()``: every run with a marker held that still misses some, and which, per episodes partition
  (for ``rollout_bus.consumers.shard_writer.lost_markers``: markers deleted before they were read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout_bus.consumers.shard_writer.episodes import EndOfRunMarker

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    turns_partitions: int
    seen: dict[int, set[int]] = field(default_factory=dict)  # episodes partition -> turns partitions
    markers: list[EndOfRunMarker] = field(default_factory=list)


class EndOfRunTracker:
    """Gathers end-of-run markers per run id until the run is complete (see the module docstring)."""

    def __init__(self, partitions: Iterable[int]) -> None:
        self.partitions = frozenset(partitions)
        self._runs: dict[str, _Run] = {}
        self._finished: set[str] = set()

    def is_finished(self, run: str) -> bool:
        return run in self._finished

    def held(self, run: str) -> list[EndOfRunMarker]:
        """The markers of ``run`` received so far (their offsets are still held)."""
        state = self._runs.get(run)
        return list(state.markers) if state is not None else []

    def missing(self, run: str) -> dict[int, list[int]]:
        """Per episodes partition, the turns partitions whose marker has not arrived yet."""
        state = self._runs.get(run)
        if state is None:
            return {}
        wanted = set(range(state.turns_partitions))
        return {p: sorted(wanted - state.seen.get(p, set())) for p in sorted(self.partitions)
                if wanted - state.seen.get(p, set())}

    def unfinished(self) -> dict[str, dict[int, list[int]]]:
        """Every run with a marker seen that still misses some, and which (``missing``)."""
        return {run: missing for run in sorted(self._runs) if (missing := self.missing(run))}

    def add(self, marker: EndOfRunMarker) -> bool:
        """Record one marker; True when it completes its run (returned once per run)."""
        if marker.run in self._finished:
            return False
        state = self._runs.setdefault(marker.run, _Run(marker.turns_partitions))
        if marker.turns_partitions != state.turns_partitions:
            logger.warning("end-of-run markers of run=%s disagree on turns_partitions (%d, %d): waiting for %d",
                           marker.run, state.turns_partitions, marker.turns_partitions,
                           max(state.turns_partitions, marker.turns_partitions))
            state.turns_partitions = max(state.turns_partitions, marker.turns_partitions)
        state.seen.setdefault(marker.partition, set()).add(marker.turns_partition)
        state.markers.append(marker)
        complete = not self.missing(marker.run)
        if complete:
            logger.info("end of run run=%s: every turns partition's marker (%d) arrived on every episodes "
                        "partition (%d)", marker.run, state.turns_partitions, len(self.partitions))
        return complete

    def finished(self, run: str) -> list[EndOfRunMarker]:
        """The run's flush is written: forget its state and return its markers, to release."""
        self._finished.add(run)
        state = self._runs.pop(run, None)
        return state.markers if state is not None else []
