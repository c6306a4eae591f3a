"""rollout_bus.consumers.shard_writer.delivery.Outbox: every send confirmed, failed ones re-sent, oversized ones replaced."""

from __future__ import annotations

import pytest
from kafka import errors as kafka_errors
from kafka.future import Future

import rollout_bus.consumers.shard_writer.delivery as delivery
from rollout_bus.consumers.shard_writer.delivery import Outbox, Outgoing
from rollout_bus.errors import BrokerError


class FakeProducer:
    """Futures settle on flush with the outcome scripted per (topic, value): the first entry is used, then dropped."""

    def __init__(self, outcomes=None, refuse_at_send=()):
        self.outcomes = dict(outcomes or {})
        self.refuse_at_send = set(refuse_at_send)
        self.sent: list[tuple[str, bytes | None]] = []
        self._open: list[tuple[Future, str, bytes | None]] = []

    def send(self, topic, key=None, value=None, headers=None):
        if value in self.refuse_at_send:
            raise kafka_errors.MessageSizeTooLargeError("over max_request_size")
        self.sent.append((topic, value))
        future = Future()
        self._open.append((future, topic, value))
        return future

    def flush(self, timeout=None):
        for future, topic, value in self._open:
            script = self.outcomes.get((topic, value), [])
            outcome = script.pop(0) if script else None
            future.failure(outcome) if outcome is not None else future.success("ok")
        self._open = []


def record(value: bytes, topic: str = "dlq") -> Outgoing:
    return Outgoing(topic, b"k", value, [("h", b"1")], "test record")


def test_a_send_that_failed_transiently_is_sent_again_until_it_is_acknowledged():
    producer = FakeProducer({("dlq", b"a"): [kafka_errors.KafkaTimeoutError("expired"),
                                             kafka_errors.NotLeaderForPartitionError()]})
    outbox = Outbox(producer)
    outbox.send(record(b"a"))
    outbox.send(record(b"b"))
    outbox.confirm()
    assert producer.sent == [("dlq", b"a"), ("dlq", b"b"), ("dlq", b"a"), ("dlq", b"a")]
    assert outbox.unconfirmed == 0 and outbox.resent == 2


@pytest.mark.parametrize("at_send", [True, False], ids=["refused-by-producer", "refused-by-broker"])
def test_a_record_refused_for_its_size_is_replaced_by_what_the_callback_returns(at_send):
    refused = kafka_errors.MessageSizeTooLargeError("too big")
    producer = FakeProducer({} if at_send else {("dlq", b"huge"): [refused]},
                            refuse_at_send=[b"huge"] if at_send else [])
    outbox = Outbox(producer)
    seen = []

    def by_reference(original, exc):
        seen.append((original.value, type(exc)))
        return Outgoing(original.topic, original.key, None, original.headers, "by reference")

    outbox.send(record(b"huge"), too_large=by_reference)
    outbox.confirm()
    assert seen == [(b"huge", kafka_errors.MessageSizeTooLargeError)]
    assert producer.sent[-1] == ("dlq", None) and outbox.unconfirmed == 0


def test_a_record_refused_for_its_size_without_a_callback_is_an_error():
    outbox = Outbox(FakeProducer(refuse_at_send=[b"manifest"]))
    with pytest.raises(BrokerError, match="over the size limit"):
        outbox.send(record(b"manifest", topic="shards"))


def test_a_permanent_delivery_failure_is_an_error():
    outbox = Outbox(FakeProducer({("dlq", b"a"): [kafka_errors.TopicAuthorizationFailedError()]}))
    outbox.send(record(b"a"))
    with pytest.raises(BrokerError, match="TopicAuthorizationFailedError"):
        outbox.confirm()


def test_a_flush_that_times_out_is_waited_through(monkeypatch):
    class SlowProducer(FakeProducer):
        calls = 0

        def flush(self, timeout=None):
            SlowProducer.calls += 1
            if SlowProducer.calls < 3:
                raise kafka_errors.KafkaTimeoutError("Timeout waiting for future")
            super().flush(timeout)

    producer = SlowProducer()
    outbox = Outbox(producer)
    outbox.send(record(b"a"))
    original = delivery.retrying
    monkeypatch.setattr(delivery, "retrying", lambda op, what, **kw: original(op, what, sleep=lambda s: None, **kw))
    outbox.confirm()
    assert SlowProducer.calls == 3 and outbox.unconfirmed == 0
