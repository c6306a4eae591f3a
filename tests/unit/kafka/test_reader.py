"""rollout_bus.kafka.reader.TopicReader.read_to_end: a deadline on the whole read, or (``stall_s``) on progress."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout_bus.errors import BrokerError, MissingTopicError, Unavailable
from rollout_bus.kafka import reader as reader_module
from rollout_bus.kafka.clients import TopicPartition
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.kafka.retry import is_transient

TOPIC = "rollout.shards"
TP = TopicPartition(TOPIC, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class FakeConsumer:
    """One partition of ``end`` records; a record arrives every ``every`` polls, each poll takes 1 s."""

    def __init__(self, clock: Clock, end: int, every: int, unresolved: int = 0) -> None:
        self.clock, self.end, self.every, self.unresolved = clock, end, every, unresolved
        self.next, self.polls, self.closed, self.timeouts = 0, 0, False, []

    def assign(self, tps):
        self.assigned = list(tps)

    def assignment(self):
        return set(self.assigned)

    def seek_to_beginning(self, *tps):
        self.next = 0

    def end_offsets(self, tps, timeout_ms=None):
        self.timeouts.append(("end_offsets", timeout_ms))
        return {tp: self.end for tp in tps}

    def position(self, tp, timeout_ms=None):
        self.timeouts.append(("position", timeout_ms))
        if self.unresolved:  # kafka-python returns None when the offset is not resolved within timeout_ms
            self.unresolved -= 1
            return None
        return self.next

    def poll(self, timeout_ms=0, max_records=None):
        self.clock.now += 1.0
        self.polls += 1
        if self.next >= self.end or self.polls % self.every:
            return {}
        self.next += 1
        return {TP: [SimpleNamespace(topic=TOPIC, offset=self.next - 1, value=b"v", headers=[])]}

    def close(self):
        self.closed = True


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(reader_module, "time", clock)
    monkeypatch.setattr(reader_module, "wait_for_partitions", lambda consumer, topic: [0])
    return clock


def open_reader(monkeypatch, consumer) -> TopicReader:
    monkeypatch.setattr(reader_module, "group_less_consumer", lambda conn, client_id: consumer)
    return TopicReader({"bootstrap_servers": "x"}, [TOPIC])


def test_without_stall_s_the_whole_read_has_a_deadline(clock, monkeypatch):
    reader = open_reader(monkeypatch, FakeConsumer(clock, end=10, every=3))
    with pytest.raises(BrokerError, match="within 5s") as caught:
        reader.read_to_end(timeout_s=5)
    assert not is_transient(caught.value)


def test_with_stall_s_a_slow_read_goes_on_as_long_as_records_come(clock, monkeypatch):
    consumer = FakeConsumer(clock, end=10, every=3, unresolved=2)
    got = open_reader(monkeypatch, consumer).read_to_end(timeout_s=5, stall_s=5)[TOPIC]
    assert [r.offset for r in got] == list(range(10)) and clock.now > 5
    assert set(consumer.timeouts) == {("end_offsets", 5000), ("position", 5000)}  # an outage never blocks it


def test_with_stall_s_no_record_for_that_long_is_unavailable_so_a_caller_retries(clock, monkeypatch):
    reader = open_reader(monkeypatch, FakeConsumer(clock, end=10, every=100))
    with pytest.raises(Unavailable, match="for 5s") as caught:
        reader.read_to_end(stall_s=5)
    assert is_transient(caught.value) and clock.now < 10


def test_a_reader_that_cannot_find_its_topic_closes_its_consumer(clock, monkeypatch):
    consumer = FakeConsumer(clock, end=0, every=1)

    def missing(consumer, topic):
        raise MissingTopicError(f"topic {topic!r} has no partitions")
    monkeypatch.setattr(reader_module, "wait_for_partitions", missing)
    with pytest.raises(MissingTopicError):
        open_reader(monkeypatch, consumer)
    assert consumer.closed
