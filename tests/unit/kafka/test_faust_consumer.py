"""A changelog record that Faust fetched but did not deliver (a rebalance stopped the flow) is read
again: its partition is sought back to it. Without this a worker's table recovery waited forever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import faust.transport.consumer as faust_consumer
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP

from rollout_bus.kafka.faust_consumer import (ChangelogKeepingConsumer, ChangelogKeepingTransport, changelog_pauses,
                                              undelivered_starts)

CHANGELOG = "app-state-changelog"
TURNS = "rollout.turns"


def _records(tp: TP, first: int, last: int) -> list:
    return [SimpleNamespace(offset=o) for o in range(first, last + 1)]


def test_the_first_undelivered_record_of_each_changelog_partition_is_named():
    log9, log10, turns = TP(CHANGELOG, 9), TP(CHANGELOG, 10), TP(TURNS, 9)
    fetched = {log9: _records(log9, 0, 12), log10: _records(log10, 5, 7), turns: _records(turns, 3, 4)}
    assert undelivered_starts(fetched, {}, {CHANGELOG}) == {log9: 0, log10: 5}
    assert undelivered_starts(fetched, {log9: 4, log10: 3}, {CHANGELOG}) == {log9: 4}
    assert undelivered_starts(fetched, {log9: 13, log10: 3}, {CHANGELOG}) == {}


def test_aiokafka_fetches_a_changelog_partition_only_while_faust_reads_it():
    log0, log1, log2, turns0 = TP(CHANGELOG, 0), TP(CHANGELOG, 1), TP(CHANGELOG, 2), TP(TURNS, 0)
    assigned = {log0, log1, log2, turns0}
    # after recovery (or with nothing to recover) Faust reads only the source: every changelog partition is paused
    assert changelog_pauses(assigned, {turns0}, set(), {CHANGELOG}) == ({log0, log1, log2}, set())
    # a recovery of partition 1 puts it in Faust's active set: resumed; the paused ones stay, nothing twice
    assert changelog_pauses(assigned, {turns0, log1}, {log0, log1, log2}, {CHANGELOG}) == (set(), {log1})
    # the source topic's partitions are Faust's flow control, never touched here
    assert changelog_pauses(assigned, set(), set(), {CHANGELOG}) == ({log0, log1, log2}, set())
    assert changelog_pauses({turns0}, set(), {turns0}, {CHANGELOG}) == (set(), set())


class _Stub(ChangelogKeepingConsumer):
    """The real subclass over a stand-in for the consumer thread: positions and seeks are recorded."""

    def __init__(self, fetched, positions, assigned):
        self.app = SimpleNamespace(tables=SimpleNamespace(changelog_topics={CHANGELOG}))
        self.positions, self.assigned, self.sought, self.canned = dict(positions), set(assigned), [], fetched

    def assignment(self):
        return self.assigned

    async def position(self, tp):
        return self.positions[tp]

    async def seek(self, tp, offset):
        self.sought.append((tp, offset))


def _run(consumer, deliver):
    """Faust's getmany replaced by one that fetches the canned batch and hands on ``deliver`` records
    per partition (the rest dropped, as Faust drops them when the flow stops mid-batch)."""

    async def fetch(self, active_partitions, timeout):
        return self.canned

    async def getmany(self, timeout):
        records = await self._getmany(set(), timeout)
        for tp, recs in records.items():
            for record in recs[:deliver.get(tp, 0)]:
                yield tp, record

    async def drain():
        return [(tp, r.offset) async for tp, r in consumer.getmany(1.0)]

    saved = aiokafka_driver.Consumer._getmany, faust_consumer.Consumer.getmany
    aiokafka_driver.Consumer._getmany, faust_consumer.Consumer.getmany = fetch, getmany
    try:
        return asyncio.run(drain())
    finally:
        aiokafka_driver.Consumer._getmany, faust_consumer.Consumer.getmany = saved


def test_changelog_records_dropped_after_the_fetch_are_sought_back_and_others_are_left_alone():
    log9, log10, log11, turns = TP(CHANGELOG, 9), TP(CHANGELOG, 10), TP(CHANGELOG, 11), TP(TURNS, 0)
    fetched = {log9: _records(log9, 0, 12), log10: _records(log10, 0, 3), log11: _records(log11, 20, 22),
               turns: _records(turns, 0, 5)}
    consumer = _Stub(fetched, positions={log9: 13, log10: 4, log11: 20, turns: 6}, assigned={log9, log10, log11, turns})
    got = _run(consumer, deliver={log9: 2, log10: 4, turns: 1})
    assert got == [(log9, 0), (log9, 1), (log10, 0), (log10, 1), (log10, 2), (log10, 3), (turns, 0)]
    # 9: delivered 0..1, position 13 -> back to 2; 10: all delivered; 11: already sought back to 20 (a new
    # recovery did it): untouched; the source topic is Faust's own business (re-read from its commit)
    assert consumer.sought == [(log9, 2)]


def test_a_partition_no_longer_assigned_is_not_sought():
    log9 = TP(CHANGELOG, 9)
    consumer = _Stub({log9: _records(log9, 0, 12)}, positions={log9: 13}, assigned=set())
    assert _run(consumer, deliver={}) == []
    assert consumer.sought == []


def test_the_transport_builds_that_consumer():
    assert ChangelogKeepingTransport.Consumer is ChangelogKeepingConsumer
