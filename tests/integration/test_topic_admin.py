"""ensure_topics sizes every topic for the largest record: creates them so, raises existing ones, warns when refused."""

from __future__ import annotations

import logging
import uuid

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import ClusterAuthorizationFailedError

from rollout_bus.kafka.admin import ensure_topics, existing_topics, raise_record_limits
from rollout_bus.kafka.limits import topic_config
from rollout_bus.wire.topics import Topics

pytestmark = pytest.mark.kafka
LIMIT = "max.message.bytes"


def configs(client_kwargs: dict, names: list[str], keys: list[str]) -> dict[str, dict[str, str]]:
    admin = KafkaAdminClient(**client_kwargs)
    try:
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n, keys) for n in names],
                                       config_filter="all")["topic"]
    finally:
        admin.close()
    return {name: {k: found[name][k]["value"] for k in keys} for name in names}


def test_every_topic_is_created_with_the_record_size_limit_of_max_record_bytes(client_kwargs):
    topics = Topics(prefix=f"a{uuid.uuid4().hex[:10]}.")
    created = ensure_topics(client_kwargs, topics, max_record_bytes=8 << 20)
    assert sorted(created) == sorted(topics.names())
    wanted = topic_config(8 << 20)[LIMIT]
    assert {n: c[LIMIT] for n, c in configs(client_kwargs, topics.names(), [LIMIT]).items()} == \
        {n: wanted for n in topics.names()}
    # nothing expires under a stalled stage: every record kept, but the compacted weights' latest per key
    kept = configs(client_kwargs, topics.names(), ["retention.ms", "retention.bytes", "cleanup.policy"])
    for name, found in kept.items():
        expected = ({"cleanup.policy": "compact"} if name == topics.weights
                    else {"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"})
        assert {k: found[k] for k in expected} == expected, (name, found)
    assert ensure_topics(client_kwargs, topics, max_record_bytes=8 << 20) == []  # idempotent
    assert existing_topics(client_kwargs, [topics.turns, "no-such-topic-here"]) == {topics.turns}


def test_an_existing_topic_with_a_smaller_limit_is_raised_keeping_its_other_settings(client_kwargs, caplog):
    topics = Topics(prefix=f"a{uuid.uuid4().hex[:10]}.")
    admin = KafkaAdminClient(**client_kwargs)
    try:  # as an older version, or a person, would have made them
        admin.create_topics({topics.turns: {"num_partitions": 2, "replication_factor": 1,
                                            "configs": {"cleanup.policy": "compact", "retention.ms": "3600000"}},
                             topics.dlq: {"num_partitions": 1, "replication_factor": 1,
                                          "configs": {LIMIT: str(200 << 20)}}})
    finally:
        admin.close()
    caplog.set_level(logging.INFO, logger="rollout_bus.kafka.admin")
    created = ensure_topics(client_kwargs, topics)
    assert topics.turns not in created and topics.dlq not in created
    found = configs(client_kwargs, [topics.turns, topics.dlq], [LIMIT, "cleanup.policy", "retention.ms"])
    assert found[topics.turns] == {LIMIT: topic_config()[LIMIT], "cleanup.policy": "compact", "retention.ms": "3600000"}
    assert found[topics.dlq][LIMIT] == str(200 << 20)  # already larger: left alone
    assert any(f"raised {LIMIT} topic={topics.turns}" in r.getMessage() for r in caplog.records)


class RefusingAdmin:
    """Describes a small limit, refuses every change (as a cluster without ALTER_CONFIGS rights would)."""

    def describe_configs(self, resources, config_filter="all"):
        return {"topic": {r.name: {LIMIT: {"value": "1048588"}} for r in resources}}

    def alter_configs(self, resources):
        raise ClusterAuthorizationFailedError("no ALTER_CONFIGS")


def test_a_refused_raise_is_a_warning_naming_the_topic_and_both_sizes(caplog):
    caplog.set_level(logging.WARNING, logger="rollout_bus.kafka.admin")
    assert raise_record_limits(RefusingAdmin(), ["x.rollout.turns"], 68157440) == []
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "topic=x.rollout.turns" in line and "1048588" in line and "68157440" in line


class LaggingAdmin:
    """Accepts the change, then describes the old limit ``lag`` more times before the new one (KRaft: a broker
    applies the controller's config record a moment after the change was accepted)."""

    def __init__(self, lag: int):
        self.lag, self.limit, self.describes = lag, "1048588", 0

    def describe_configs(self, resources, config_filter="all"):
        self.describes += 1
        if self.limit != "1048588":
            self.lag -= 1
        shown = self.limit if self.lag < 0 else "1048588"
        return {"topic": {r.name: {LIMIT: {"value": shown}} for r in resources}}

    def alter_configs(self, resources):
        self.limit = resources[0].configs[LIMIT]
        return {"topic": {resources[0].name: "OK"}}


def test_a_raised_limit_is_returned_once_the_cluster_describes_it(caplog):
    admin = LaggingAdmin(lag=3)
    assert raise_record_limits(admin, ["x.rollout.turns"], 68157440) == ["x.rollout.turns"]
    assert admin.lag < 0 and admin.describes == 1 + 4  # the first read, then until the new limit showed


def test_a_raised_limit_the_cluster_never_describes_is_a_warning_after_the_wait(caplog, monkeypatch):
    import rollout_bus.kafka.admin as admin_module

    monkeypatch.setattr(admin_module, "LIMIT_VISIBLE_S", 0.5)
    caplog.set_level(logging.WARNING, logger="rollout_bus.kafka.admin")
    assert raise_record_limits(LaggingAdmin(lag=10**6), ["x.rollout.turns"], 68157440) == ["x.rollout.turns"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "topics=x.rollout.turns" in line and "still describes the old limit" in line


def closed_port() -> int:
    import socket
    with socket.socket() as sock:  # bound, never listening: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_cluster_that_does_not_answer_is_a_broker_error_not_a_client_traceback(caplog):
    from rollout_bus.errors import BrokerError
    from rollout_bus.kafka.admin import wait_for_cluster

    kwargs = {"bootstrap_servers": f"127.0.0.1:{closed_port()}"}
    with pytest.raises(BrokerError, match=kwargs["bootstrap_servers"]):
        ensure_topics({**kwargs, "bootstrap_timeout_ms": 1000}, Topics(prefix="nobody."))
    caplog.set_level(logging.WARNING, logger="rollout_bus.kafka.admin")
    with pytest.raises(BrokerError, match=r"no Kafka cluster answered .* within 4s: .* refuses connections"):
        wait_for_cluster(kwargs, 4.0, log_every_s=1.0, probe_timeout_s=0.5)
    waits = [r for r in caplog.records if "waiting for broker" in r.getMessage()]
    assert waits and all(kwargs["bootstrap_servers"] in w.getMessage() for w in waits)
    # every line says why: here, nothing listens on the port
    assert "refuses connections (nothing listens there" in waits[0].getMessage()


def test_waiting_for_a_cluster_that_answers_returns_at_once(client_kwargs):
    from rollout_bus.kafka.admin import wait_for_cluster

    wait_for_cluster(client_kwargs, 30.0)  # raises if it does not answer within 30 s
