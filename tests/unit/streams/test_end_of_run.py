"""The end-of-run forwarder on its own: its partition is settled before the marker goes to any episodes
partition, and a control record it cannot forward settles nothing."""

from __future__ import annotations

import asyncio
from collections import Counter

from rollout_bus.streams.end_of_run import EndOfRunForwarder
from rollout_bus.streams.rejections import Rejections
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.topics import Topics

TOPICS = Topics(prefix="u.")


def _forwarder(events: list) -> tuple[EndOfRunForwarder, Counter]:
    async def send(topic, key, value, headers, *, wait, partition=None):
        events.append(("send", topic, key, partition, wait))

    async def settle(marker):
        events.append(("settle", marker.partition))

    outcomes = Counter()
    rejects = Rejections(ChangelogState({}), send, TOPICS, outcomes, finish=lambda *a: None, forget=lambda k: None)
    return EndOfRunForwarder(send, TOPICS, outcomes, rejects, turns_partitions=4, episodes_partitions=3,
                             settle=settle), outcomes


def test_the_partition_is_settled_before_the_marker_goes_to_every_episodes_partition():
    events: list = []
    forwarder, outcomes = _forwarder(events)
    marker = EndOfRun("run-a")
    asyncio.run(forwarder.handle(TurnRecord(END_OF_RUN_KEY, marker.value(), marker.headers(), "turns", 2, 7, 5),
                                 "end-of-run"))
    assert events == [("settle", 2)] + [("send", TOPICS.episodes, END_OF_RUN_KEY, p, True) for p in range(3)]
    assert outcomes["control_records"] == 1 and outcomes["end_of_run_forwarded"] == 1


def test_a_control_record_it_cannot_forward_is_dead_lettered_and_settles_nothing():
    events: list = []
    forwarder, outcomes = _forwarder(events)
    asyncio.run(forwarder.handle(TurnRecord(END_OF_RUN_KEY, b"{}", EndOfRun("r").headers(), "turns", 0, 0, 1),
                                 "end-of-run"))
    asyncio.run(forwarder.handle(TurnRecord(b"k", b"", [("control", b"pause")], "turns", 0, 1, 1), "pause"))
    assert [e[0] for e in events] == ["send", "send"] and {e[1] for e in events} == {TOPICS.dlq}
    assert outcomes["dlq.control"] == 2 and outcomes["end_of_run_forwarded"] == 0
