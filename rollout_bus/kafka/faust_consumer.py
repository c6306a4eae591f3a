"""A Faust consumer that never loses a changelog record it fetched but did not deliver.

Why: Faust (0.15) hands aiokafka its live set of active partitions; when a rebalance empties that set
while a fetch waits, aiokafka drains every partition's buffered records (an empty set means "all"),
and Faust then drops what it did not ask for, or everything when the flow is stopped. The consumer's
position has moved past those records. A source topic is re-read from its committed offset after
every rebalance, but a table's changelog is not: table recovery seeks once, waits for records up to
the changelog's high-water mark that were already drained and dropped, and never completes (the
worker logs "No event received for active tp ... since recovery start" forever and takes no turns).

Here, after every fetched batch, each changelog partition with records that were not handed on is
sought back to the first of them, unless its position is already at or before it (recovery only
applies offsets it has not seen, so reading a record twice is harmless).

Nor does it fetch a changelog it is not recovering: Faust hands aiokafka every assigned partition, the state
changelog's too (it pauses partitions only in its own bookkeeping), and delivers only its active ones. aiokafka
holds a fetched partition's records until they are consumed and meanwhile sends no fetch to that broker for up
to its prefetch backoff (100 ms). A worker's own first changelog writes, fetched and never consumed, so stalled
every partition of a one-broker cluster for ~100 ms at the start of a run (the paced p99 latency was that
stall). Before each fetch the consumer thread pauses, in aiokafka, each changelog partition outside Faust's
active set and resumes each inside it (recovery puts the ones it reads there).

Contract: ``ChangelogKeepingTransport`` is Faust's aiokafka transport with that consumer;
``undelivered_starts(fetched, delivered, topics)`` is the pure rule: ``{tp: first offset not
delivered}`` over the partitions of ``topics``; ``changelog_pauses(assigned, active, paused, topics)`` the
other: which changelog partitions to pause and to resume in aiokafka.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

from faust.transport.drivers import aiokafka as aiokafka_driver

logger = logging.getLogger(__name__)


def undelivered_starts(fetched: Mapping[Any, Sequence[Any]], delivered: Mapping[Any, int],
                       topics: Collection[str]) -> dict[Any, int]:
    """The offset of the first record of each partition of ``topics`` that was fetched (records in
    offset order) but not delivered (``delivered[tp]`` records were, from the first)."""
    starts = {}
    for tp, records in fetched.items():
        handed_on = delivered.get(tp, 0)
        if tp.topic in topics and handed_on < len(records):
            starts[tp] = records[handed_on].offset
    return starts


def changelog_pauses(assigned: Collection[Any], active: Collection[Any], paused: Collection[Any],
                     topics: Collection[str]) -> tuple[set[Any], set[Any]]:
    """(to pause, to resume) in aiokafka: each assigned partition of ``topics`` fetched only while active."""
    changelog = {tp for tp in assigned if tp.topic in topics}
    wanted = {tp for tp in changelog if tp not in active}
    return wanted - set(paused), (changelog - wanted) & set(paused)


class _ActiveOnlyThread(aiokafka_driver.AIOKafkaConsumerThread):
    """Faust's consumer thread; aiokafka fetches a changelog partition only while Faust reads it."""

    async def _fetch_records(self, consumer: Any, active_partitions: Any, timeout: float | None = None,
                             max_records: int | None = None) -> Any:
        active = set(active_partitions or ())  # Faust's live set: read once
        pause, resume = changelog_pauses(consumer.assignment(), active, consumer.paused(),
                                         self.consumer.app.tables.changelog_topics)
        if pause:
            consumer.pause(*pause)
        if resume:
            consumer.resume(*resume)
        return await super()._fetch_records(consumer, active_partitions, timeout=timeout, max_records=max_records)


class ChangelogKeepingConsumer(aiokafka_driver.Consumer):
    """Faust's aiokafka consumer; a changelog record fetched but not delivered is fetched again."""

    _fetched: Mapping[Any, Sequence[Any]] | None = None

    def _new_consumer_thread(self) -> Any:
        return _ActiveOnlyThread(self, loop=self.loop, beacon=self.beacon)

    async def _getmany(self, active_partitions: Any, timeout: float) -> Any:
        self._fetched = await super()._getmany(active_partitions, timeout)
        return self._fetched

    async def getmany(self, timeout: float) -> AsyncIterator[Any]:
        self._fetched = None
        delivered: dict[Any, int] = {}
        async for tp, message in super().getmany(timeout):
            delivered[tp] = delivered.get(tp, 0) + 1
            yield tp, message
        starts = undelivered_starts(self._fetched or {}, delivered, self.app.tables.changelog_topics)
        if starts:
            await self._rewind(starts)

    async def _rewind(self, starts: Mapping[Any, int]) -> None:
        assigned = self.assignment()
        for tp, offset in starts.items():
            if tp not in assigned:
                continue
            position = await self.position(tp)
            if position is not None and position > offset:
                logger.info("%s[%d]: changelog records from offset %d were fetched during a rebalance but not "
                            "delivered; reading them again (position was %d)", tp.topic, tp.partition, offset,
                            position)
                await self.seek(tp, offset)


class ChangelogKeepingTransport(aiokafka_driver.Transport):
    """Faust's aiokafka transport with ``ChangelogKeepingConsumer``."""

    Consumer = ChangelogKeepingConsumer
