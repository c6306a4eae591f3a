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


def test_the_authorization_refusals_of_a_secured_cluster_say_what_to_check():
    from kafka.errors import (ClusterAuthorizationFailedError, GroupAuthorizationFailedError,
                              SaslAuthenticationFailedError, TopicAuthorizationFailedError)

    assert "check its ACLs, or the --topic-prefix" in explain(TopicAuthorizationFailedError("rollout.weights"))
    assert "consumer group: check its ACLs" in explain(GroupAuthorizationFailedError("rollout-bus-shards"))
    assert "may write no topic" in explain(ClusterAuthorizationFailedError())
    assert "ROLLOUT_BUS_SASL_PASSWORD_FILE" in explain(SaslAuthenticationFailedError("bad login"))


def test_a_generic_client_error_that_names_the_brokers_refusal_gets_its_hint():
    from kafka.errors import KafkaError

    text = explain(KafkaError("Unexpected error in InitProducerIdResponse: [Error 31] ClusterAuthorizationFailedError"))
    assert text.endswith("check its role's ACLs") and text.startswith("KafkaError: Unexpected error")
