"""rollout_bus.kafka.retry: which errors are transient, backoff, one warning per retry, stopping."""

from __future__ import annotations

import logging

import pytest
from kafka import errors as kafka_errors

from rollout_bus.kafka.retry import Backoff, Stopped, Unavailable, is_too_large, is_transient, retrying


@pytest.mark.parametrize("exc, transient", [
    (kafka_errors.KafkaTimeoutError("Unable to bootstrap"), True),
    (kafka_errors.KafkaConnectionError("refused"), True),
    (kafka_errors.NotCoordinatorError(), True),
    (kafka_errors.CoordinatorNotAvailableError(), True),
    (kafka_errors.RequestTimedOutError(), True),
    (ConnectionResetError(), True),
    (Unavailable("topic has no partitions yet"), True),
    (kafka_errors.CommitFailedError(), False),
    (kafka_errors.MessageSizeTooLargeError(), False),
    (kafka_errors.TopicAuthorizationFailedError(), False),
    (kafka_errors.IllegalStateError(), False),
    (ValueError("bug"), False),
])
def test_transient_errors_are_the_ones_a_returning_broker_clears(exc, transient):
    assert is_transient(exc) is transient


def test_size_refusals_are_recognised_also_when_wrapped():
    assert is_too_large(kafka_errors.MessageSizeTooLargeError())
    assert is_too_large(kafka_errors.RecordListTooLargeError())
    try:
        try:
            raise kafka_errors.MessageSizeTooLargeError("big")
        except kafka_errors.KafkaError as inner:
            raise RuntimeError("send failed") from inner
    except RuntimeError as outer:
        assert is_too_large(outer)
    assert not is_too_large(kafka_errors.KafkaTimeoutError())


def test_backoff_doubles_from_half_a_second_up_to_ten():
    assert [Backoff().delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_retrying_waits_through_transient_errors_with_one_warning_each(caplog):
    failures = [kafka_errors.KafkaTimeoutError("broker away")] * 4
    slept: list[float] = []

    def operation():
        if failures:
            raise failures.pop()
        return "committed"

    with caplog.at_level(logging.WARNING, logger="rollout_bus.kafka.retry"):
        assert retrying(operation, "commit offsets", sleep=slept.append) == "committed"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert lines[2] == "waiting for broker: commit offsets (attempt 3, next in 2.0s): KafkaTimeoutError: broker away"
    assert sum(slept) == pytest.approx(0.5 + 1 + 2 + 4)


def test_retrying_raises_other_errors_at_once():
    calls = []

    def operation():
        calls.append(1)
        raise kafka_errors.CommitFailedError()

    with pytest.raises(kafka_errors.CommitFailedError):
        retrying(operation, "commit offsets", sleep=lambda s: None)
    assert len(calls) == 1


def test_a_stop_request_ends_the_wait():
    stop = []

    def operation():
        stop.append(1)  # asked to stop after the first failure
        raise kafka_errors.KafkaTimeoutError()

    with pytest.raises(Stopped) as caught:
        retrying(operation, "poll", should_stop=lambda: bool(stop), sleep=lambda s: None)
    assert isinstance(caught.value.__cause__, kafka_errors.KafkaTimeoutError)


def test_a_missing_topic_is_named_as_missing_not_as_a_broker_wait(caplog):
    from rollout_bus.errors import MissingTopicError

    failures = [MissingTopicError("topic 'run7.rollout.shards' has no partitions in the cluster's metadata")]

    def operation():
        if failures:
            raise failures.pop()
        return "read"

    with caplog.at_level(logging.WARNING, logger="rollout_bus.kafka.retry"):
        assert retrying(operation, "read announcements from rollout.shards", sleep=lambda s: None) == "read"
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("waiting for a topic to be created: read announcements from rollout.shards (attempt 1")
    assert "run7.rollout.shards" in line and "--topic-prefix" in line and "waiting for broker" not in line
