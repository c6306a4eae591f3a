"""``wait_for_partitions``: a broker that is down but still in the cached metadata is waited out, not raised."""

from __future__ import annotations

import pytest
from kafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from rollout_bus.errors import BrokerError, MissingTopicError
from rollout_bus.kafka import clients


class MetadataConsumer:
    """Answers ``partitions_for_topic`` from a script: an exception to raise, or the partitions to return."""

    config = {"bootstrap_servers": "127.0.0.1:1"}

    def __init__(self, script):
        self.script = list(script)
        self.asked = 0

    def partitions_for_topic(self, topic):
        self.asked += 1
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        return step

    def topics(self):
        return set()


@pytest.fixture(autouse=True)
def visible(monkeypatch):
    monkeypatch.setattr(clients, "_check_visible", lambda conn, topic: None)
    monkeypatch.setattr(clients.time, "sleep", lambda s: None)


def test_a_refused_connection_to_a_dead_broker_is_retried_until_the_partitions_come():
    consumer = MetadataConsumer([KafkaConnectionError("111 ECONNREFUSED")] * 3 + [{1, 0}])
    assert clients.wait_for_partitions(consumer, "rollout.turns", timeout_s=30) == [0, 1]
    assert consumer.asked == 4


def test_a_metadata_that_never_answers_is_a_broker_error_naming_the_topic_and_the_last_error():
    consumer = MetadataConsumer([KafkaConnectionError("111 ECONNREFUSED")])
    with pytest.raises(BrokerError, match=r"looking up topic 'rollout.turns'.*ECONNREFUSED"):
        clients.wait_for_partitions(consumer, "rollout.turns", timeout_s=0)


def test_a_missing_topic_after_a_passing_outage_is_still_said_missing():
    consumer = MetadataConsumer([KafkaConnectionError("down"), set()])
    with pytest.raises(MissingTopicError, match="rollout.turns"):
        clients.wait_for_partitions(consumer, "rollout.turns", timeout_s=0.05)


def test_an_error_that_is_not_retriable_is_raised_at_once():
    consumer = MetadataConsumer([TopicAuthorizationFailedError("rollout.turns")])
    with pytest.raises(TopicAuthorizationFailedError):
        clients.wait_for_partitions(consumer, "rollout.turns", timeout_s=30)
    assert consumer.asked == 1
