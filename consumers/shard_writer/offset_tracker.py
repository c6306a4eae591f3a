"""Commit positions for the shard writer: never past a record whose decision is not written yet.

Contract: per partition, ``positions()`` is the smallest offset still held (``hold`` without a
matching ``release``), else one past the highest offset ``seen``. Episodes, abandoned records and
end-of-run markers are held until the batch (or flush) they take part in is written or
dead-lettered, so a crash before that re-reads them after a restart. ``release`` is O(1) (lazy
deletion); a held offset may be held and released more than once (a duplicate record at the same
offset never happens, but nothing breaks if it does).
"""

from __future__ import annotations

import heapq
from collections import Counter


class OffsetTracker:
    """Per-partition commit positions that never pass a record still held."""

    def __init__(self) -> None:
        self._next: dict[int, int] = {}
        self._held: dict[int, list[int]] = {}
        self._released: dict[int, Counter[int]] = {}

    def seen(self, partition: int, offset: int) -> None:
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def hold(self, partition: int, offset: int) -> None:
        heapq.heappush(self._held.setdefault(partition, []), offset)

    def release(self, partition: int, offset: int) -> None:
        self._released.setdefault(partition, Counter())[offset] += 1

    def positions(self) -> dict[int, int]:
        """The offset to commit per partition: the first held one, else one past the last seen."""
        out = {}
        for partition, nxt in self._next.items():
            heap, released = self._held.get(partition, []), self._released.get(partition, Counter())
            while heap and released[heap[0]] > 0:  # lazy deletion keeps release O(1)
                released[heap[0]] -= 1
                if not released[heap[0]]:
                    del released[heap[0]]
                heapq.heappop(heap)
            out[partition] = heap[0] if heap else nxt
        return out

    def pending(self) -> int:
        """Offsets held and not yet released."""
        released = sum(sum(c.values()) for c in self._released.values())
        return sum(len(h) for h in self._held.values()) - released
