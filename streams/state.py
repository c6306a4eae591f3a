"""The stream stage's state mapping: a local store plus our own, ordered changelog writes.

Contract: ``ChangelogState(store, publish)`` is a ``MutableMapping[bytes, bytes]`` over ``store``
(the Faust table's memory store, or a dict). Each write or delete is applied to the store at once
and queued as a changelog record (a delete as a tombstone) for the partition set with
``bind(partition)``; ``await flush()`` hands the queued records to ``publish``, one call per
partition with that partition's records in write order (the order recovery replays; partitions are
independent logs). The app's ``publish`` builds them into record batches for the aiokafka producer
(enqueued, not awaited): one call per partition and flush, not one ``send`` per record. Faust's
recovery reads the same changelog topic back into the store.

Why not write through the Faust table: its changelog records go through a ``ProducerBuffer``
whose ``flush`` gives up after 0.1 s, so a source offset can be committed while its state
writes still sit in that buffer (lost on a crash, or clobbered by re-recovery on a rebalance).
Records handed to aiokafka before an event is acknowledged are flushed by the commit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping

Publish = Callable[[int, list[tuple[bytes, bytes | None]]], Awaitable[None]]


class ChangelogState(MutableMapping):
    """Store writes now, changelog writes on ``flush``; ``publish=None`` keeps no changelog (tests)."""

    def __init__(self, store: MutableMapping, publish: Publish | None = None) -> None:
        self.store = store
        self.publish = publish
        self.partition = 0
        self.pending: list[tuple[int, bytes, bytes | None]] = []
        self.changelog_records = 0
        self.changelog_bytes = 0

    def bind(self, partition: int) -> None:
        """Changelog partition of the writes that follow (the source record's partition)."""
        self.partition = partition

    def _queue(self, key: bytes, value: bytes | None) -> None:
        self.pending.append((self.partition, key, value))
        self.changelog_records += 1
        self.changelog_bytes += len(key) + (len(value) if value is not None else 0)

    def __getitem__(self, key: bytes) -> bytes:
        return self.store[key]

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.store[key] = value
        self._queue(key, value)

    def __delitem__(self, key: bytes) -> None:
        del self.store[key]
        self._queue(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self.store

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.store.keys()))

    def __len__(self) -> int:
        return len(self.store)

    async def flush(self) -> None:
        """Hand the queued changelog records to the producer: per partition, in write order."""
        pending, self.pending = self.pending, []
        if self.publish is None or not pending:
            return
        by_partition: dict[int, list[tuple[bytes, bytes | None]]] = {}
        for partition, key, value in pending:
            by_partition.setdefault(partition, []).append((key, value))
        for partition, records in by_partition.items():
            await self.publish(partition, records)
