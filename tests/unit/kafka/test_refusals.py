"""Kafka's refusals that a person can fix carry what to check; others are described as they are."""

from __future__ import annotations

from kafka.errors import InvalidTimestampError, InvalidTopicError, KafkaTimeoutError

from rollout_bus.kafka.refusals import explain


def test_a_timestamp_refusal_says_to_check_the_clock_and_shows_this_hosts_time():
    text = explain(InvalidTimestampError("Timestamp 1796480130203 of message with offset 0 is out of range"))
    assert text.startswith("[Error 32] InvalidTimestampError: Timestamp 1796480130203")
    assert "check this host's clock (it says 20" in text and "log.message.timestamp.after.max.ms" in text


def test_an_invalid_topic_names_the_prefix_flag_and_other_errors_are_only_described():
    assert "check --topic-prefix" in explain(InvalidTopicError("bad"))
    assert explain(KafkaTimeoutError("no answer")) == "KafkaTimeoutError: no answer"


def test_a_subclass_from_another_library_is_matched_by_class_name():
    class InvalidTimestampError(Exception):  # e.g. aiokafka's own class of the same name
        pass

    assert "check this host's clock" in explain(InvalidTimestampError("out of range"))
