"""The stream stage's window metrics over its state table: count acknowledged finals, close windows.

Contract (``rollout_bus.streams.windows`` holds the pure bookkeeping): per source partition, tumbling
event-time windows of ``window_ms``; ``count(record, segments)`` absorbs a final turn's episode into
its (window, adapter, partition) entry, once per source offset (a replayed final is not counted
twice); ``publish_counted()`` then writes each entry counted into since the last call to the table
and to rollout.metrics, once per batch of finals rather than once per episode (the processor calls
it before it writes the batch's finished markers, so a crash replays the finals and counts them
again rather than losing them); ``close_due(partition)``
publishes every window the partition's watermark passed by ``grace_ms`` as closed (awaited), then
deletes its entry and records the partition's closed-until time. A final whose window already
closed is counted as ``window_late``. Bookkeeping is reloaded from the table after a rebalance
(``forget``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from rollout_bus.model.episode_stats import adapter_scope
from rollout_bus.model.sample import Sample
from rollout_bus.wire.topics import Topics
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.streams.windows import (PartitionWindows, WindowEntry, closed_key, window_bounds, window_key, window_record,
                             window_record_key)

logger = logging.getLogger(__name__)


class WindowMetrics:
    """Window entries of the partitions a worker holds, mirrored from the state table."""

    def __init__(self, table: ChangelogState, send: Any, topics: Topics, outcomes: Counter, *, window_ms: int,
                 grace_ms: int) -> None:
        self.table, self.send, self.topics, self.outcomes = table, send, topics, outcomes
        self.window_ms, self.grace_ms = window_ms, grace_ms
        self._partitions: dict[int, PartitionWindows] = {}
        self._entries: dict[bytes, WindowEntry] = {}  # decoded window entries, mirroring the table
        self._counted: dict[bytes, WindowEntry] = {}  # entries counted into, not yet written

    def forget(self) -> None:
        self._partitions.clear()
        self._entries.clear()
        self._counted.clear()

    def count(self, record: TurnRecord, segments: list[Sample]) -> None:
        """Absorb an acknowledged final into its window entry (once per source offset); ``publish_counted``
        writes it."""
        window = window_bounds(record.timestamp_ms, self.window_ms)
        windows = self.of(record.partition)
        if windows.is_late(window):
            self.outcomes["window_late"] += 1
            logger.warning("final turn after its window closed window=%d-%d partition=%d offset=%d",
                           window[0], window[1], record.partition, record.offset)
            return
        adapter = adapter_scope(segments[0])
        key = window_key(window[0], adapter, record.partition)
        entry = self._entries.get(key)
        if entry is None:
            raw = self.table.get(key)
            entry = WindowEntry.from_bytes(raw) if raw is not None else WindowEntry(*window, adapter, record.partition)
        if not entry.absorb(record.offset, segments):
            self.outcomes["window_replays_skipped"] += 1
            return
        self._entries[key] = entry
        self._counted[key] = entry
        windows.open[key] = entry.end_ms
        self.outcomes["window_episodes"] += 1

    async def publish_counted(self) -> None:
        """Write the entries counted into since the last call to the table, and publish them (open)."""
        counted, self._counted = self._counted, {}
        for key, entry in counted.items():
            self.table.bind(entry.partition)
            self.table[key] = entry.to_bytes()
            await self.send(self.topics.metrics, window_record_key(entry), window_record(entry, closed=False), [],
                            wait=False)

    def any_due(self, partition: int) -> bool:
        return bool(self.of(partition).due(self.grace_ms))

    async def close_due(self, partition: int) -> None:
        """Publish each window the watermark passed as closed (awaited), then delete its state."""
        windows = self.of(partition)
        if self._counted:  # counts not yet written go out first (the processor drains before closing)
            await self.publish_counted()
            self.table.bind(partition)
        for key in windows.due(self.grace_ms):
            raw = self.table.get(key)
            entry = self._entries.pop(key, None)
            if raw is not None:
                entry = entry or WindowEntry.from_bytes(raw)
                await self.send(self.topics.metrics, window_record_key(entry), window_record(entry, closed=True),
                                [], wait=True)
                del self.table[key]
                logger.info("window closed window=%d-%d adapter=%s partition=%d episodes=%d", entry.start_ms,
                            entry.end_ms, entry.adapter, partition, entry.stats.episodes)
            windows.closed(key)
            self.table[closed_key(partition)] = b"%d" % windows.closed_until_ms
            self.outcomes["windows_closed"] += 1

    def of(self, partition: int) -> PartitionWindows:
        """This partition's bookkeeping, loaded from the table on first use after (re)assignment."""
        windows = self._partitions.get(partition)
        if windows is None:
            raw = self.table.get(closed_key(partition))
            windows = PartitionWindows(closed_until_ms=int(raw) if raw is not None else -1)
            prefix = b"w|%d|" % partition
            for key in [k for k in self.table.keys() if k.startswith(prefix)]:
                windows.open[key] = WindowEntry.from_bytes(self.table[key]).end_ms
            self._partitions[partition] = windows
        return windows
