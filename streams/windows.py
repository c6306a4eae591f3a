"""Tumbling event-time windows of finished-episode metrics: pure bookkeeping, no Kafka.

Contract:

* An episode belongs to the window ``[start, start + size)`` holding its event time (the Kafka
  timestamp of its final turn record), and is counted per adapter (None: no adapter) and per
  source partition: one ``WindowEntry`` per ``(window, adapter, partition)``. Each entry keeps an
  ``EpisodeStats`` and the highest source offset of the final turns it absorbed, so a final turn
  replayed after a crash (offset <= recorded) is not counted twice.
* ``PartitionWindows`` tracks one source partition: its watermark (the highest record timestamp
  seen), its open windows, and ``closed_until_ms`` (every window ending at or before it is closed
  and deleted). A window is due to close once ``watermark >= end + grace``; a final turn whose
  window is already closed is late: it is counted as such and left out of every window.
* ``window_record(entry, closed)`` is the rollout.metrics value: ``window_metrics_record`` plus
  the partition, the offset and the ``EpisodeStats`` JSON, so that ``metrics_records.fold_window_records``
  can rebuild each window's statistics from the per-partition partials (the last record per
  ``(window, adapter, partition)`` wins, in topic order).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout_bus.wire.compact_json import compact_json
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.errors import ContractError, must_be
from rollout_bus.wire.metrics_records import window_metrics_record
from rollout_bus.model.sample import Sample

Window = tuple[int, int]  # (start_ms, end_ms)


def window_bounds(event_ms: int, size_ms: int) -> Window:
    """The tumbling window holding ``event_ms``."""
    if size_ms <= 0:
        raise ContractError(must_be("size_ms", "> 0", size_ms))
    start = (int(event_ms) // size_ms) * size_ms
    return start, start + size_ms


def window_key(start_ms: int, adapter: str | None, partition: int) -> bytes:
    """State-table key of one window entry."""
    return b"w|%d|%d|" % (partition, start_ms) + json.dumps(adapter).encode()


def closed_key(partition: int) -> bytes:
    """State-table key of a partition's ``closed_until_ms``."""
    return b"c|%d" % partition


@dataclass
class WindowEntry:
    """One window's statistics for one adapter, from one source partition."""

    start_ms: int
    end_ms: int
    adapter: str | None
    partition: int
    offset: int = -1  # highest source offset of a final turn absorbed
    stats: EpisodeStats = field(default_factory=EpisodeStats)

    @property
    def key(self) -> bytes:
        return window_key(self.start_ms, self.adapter, self.partition)

    def absorb(self, offset: int, segments: Sequence[Sample]) -> bool:
        """Count a finished episode unless this offset was already absorbed; True if counted."""
        if offset <= self.offset:
            return False
        self.stats.add_episode(segments)
        self.offset = offset
        return True

    def to_bytes(self) -> bytes:
        return compact_json({"start_ms": self.start_ms, "end_ms": self.end_ms, "adapter": self.adapter,
                             "partition": self.partition, "offset": self.offset, "stats": self.stats.to_json()})

    @classmethod
    def from_bytes(cls, raw: bytes) -> "WindowEntry":
        """Strict inverse of ``to_bytes``."""
        try:
            doc = json.loads(raw)
            return cls(int(doc["start_ms"]), int(doc["end_ms"]), doc["adapter"], int(doc["partition"]),
                       int(doc["offset"]), EpisodeStats.from_json(doc["stats"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise ContractError(must_be("window entry", "WindowEntry.to_bytes() output", raw[:200])) from exc


@dataclass
class PartitionWindows:
    """Event-time progress and open windows of one source partition."""

    watermark_ms: int = -1
    closed_until_ms: int = -1
    open: dict[bytes, int] = field(default_factory=dict)  # window key -> end_ms

    def observe(self, timestamp_ms: int) -> None:
        self.watermark_ms = max(self.watermark_ms, int(timestamp_ms))

    def is_late(self, window: Window) -> bool:
        """Whether ``window`` was already closed on this partition."""
        return window[1] <= self.closed_until_ms

    def due(self, grace_ms: int) -> list[bytes]:
        """Keys of the open windows the watermark has passed (end + grace), oldest first."""
        ready = [(end, key) for key, end in self.open.items() if self.watermark_ms >= end + grace_ms]
        return [key for _, key in sorted(ready)]

    def closed(self, key: bytes) -> None:
        end = self.open.pop(key)
        self.closed_until_ms = max(self.closed_until_ms, end)


def window_record(entry: WindowEntry, *, closed: bool) -> bytes:
    """The rollout.metrics value for one window entry."""
    return window_metrics_record(entry.start_ms, entry.end_ms, entry.adapter, entry.stats.metrics(),
                                 episodes=entry.stats.episodes, closed=closed, partition=entry.partition,
                                 offset=entry.offset, stats=entry.stats.to_json())


def window_record_key(entry: WindowEntry) -> bytes:
    """Record key on rollout.metrics: the window id."""
    return b"window:%d-%d" % (entry.start_ms, entry.end_ms)

