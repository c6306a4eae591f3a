"""Pruning the stream stage's finished-episode markers against the progress of the log.

Contract: ``FinishedMarkers(retention_records)`` keeps, per source partition, the finished
markers in the order of their final turn's offset; ``due(partition, position)`` pops the rollout
keys whose final turn lies more than ``retention_records`` before ``position`` (the partition's
recorded next offset). The stage deletes their markers (a changelog tombstone each), so its state
does not grow with the length of a run.

Why that is safe: records below a partition's recorded position are skipped by offset, so a
marker only matters for a duplicate that a producer publishes again *later in the log* (a
generator re-run with the same seed). Within the retention such a turn is recognised and ignored.
Past it, a re-published episode (turn 0 onwards) is merged and emitted again with the same
(rollout key, attempt), which the shard writer drops as a duplicate (it consults the batches on
disk once its own memory is pruned); a re-published tail that starts past turn 0 goes to the DLQ
as a gap, with its reason. Nothing is lost either way.

After a (re)assignment the order is rebuilt from the table once per partition (``load``): markers
record their partition and final offset (``EpisodeIndex``); markers written without them are
never pruned.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

FINISHED_RETENTION_RECORDS = 100_000


class FinishedMarkers:
    """Per-partition queues of (final offset, rollout key) of finished markers."""

    def __init__(self, retention_records: int = FINISHED_RETENTION_RECORDS) -> None:
        self.retention_records = retention_records
        self._queues: dict[int, deque[tuple[int, bytes]]] = {}

    def loaded(self, partition: int) -> bool:
        return partition in self._queues

    def load(self, partition: int, markers: Iterable[tuple[int, bytes]]) -> None:
        """The partition's markers as found in the table: (final offset, rollout key)."""
        self._queues[partition] = deque(sorted(markers))

    def add(self, partition: int, final_offset: int, key: bytes) -> None:
        queue = self._queues.get(partition)
        if queue is None:
            return  # not loaded yet: the load scan finds this marker in the table
        if queue and queue[-1][0] > final_offset:  # a replayed final: keep the queue ordered
            self._queues[partition] = deque(sorted([*queue, (final_offset, key)]))
        else:
            queue.append((final_offset, key))

    def due(self, partition: int, position: int) -> list[tuple[int, bytes]]:
        """Pop the markers whose final offset is below ``position - retention_records``."""
        queue = self._queues.get(partition)
        horizon = position - self.retention_records
        out = []
        while queue and queue[0][0] < horizon:
            out.append(queue.popleft())
        return out

    def forget(self) -> None:
        self._queues.clear()
