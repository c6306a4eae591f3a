"""Every Kafka client of the project, built in one place from one connection.

A connection is a ``KafkaSettings`` or its ``client_kwargs()`` (bootstrap servers and SASL/SSL in
kafka-python's spelling). From it come:

* kafka-python clients: ``new_producer``, ``new_consumer``, ``group_less_consumer`` (assign and
  seek only: no group, no commits, never creates a topic) and ``new_admin`` (an unreachable
  cluster is a ``BrokerError`` naming it);
* ``new_aio_consumer``: an aiokafka consumer with the same security (SASL/SSL as an ``ssl_context``);
* ``faust_brokers`` and ``faust_credentials``: the same connection as Faust wants it.

``wait_for_partitions(client, topic)`` is the one wait for a topic to show partitions in the
metadata (a fresh create can lag): a sorted list, or ``MissingTopicError`` after ``timeout_s``.

The few client-library names the stages need (``TopicPartition``, ``OffsetAndMetadata``,
``KafkaError`` ...) are re-exported here, so only ``rollout_bus.kafka`` imports kafka-python,
aiokafka or Faust (and ``streams/app.py``, the Faust app).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.codec import has_lz4
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.errors import KafkaError, KafkaTimeoutError, RebalanceInProgressError, TopicAuthorizationFailedError
from kafka.structs import OffsetAndMetadata

from rollout_bus.errors import BrokerError, MissingTopicError
from rollout_bus.kafka.limits import consumer_config
from rollout_bus.kafka.reachability import diagnose
from rollout_bus.kafka.refusals import is_refusal, refusal, refusals_named
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from rollout_bus.config import KafkaSettings

__all__ = ["ConsumerRebalanceListener", "CooperativeStickyAssignor", "KafkaAdminClient", "KafkaConsumer",
           "KafkaError", "KafkaProducer", "KafkaTimeoutError", "OffsetAndMetadata", "RebalanceInProgressError", "TopicPartition",
           "connection", "faust_brokers", "faust_credentials", "group_less_consumer", "has_lz4", "new_admin",
           "new_aio_consumer", "new_consumer", "new_producer", "wait_for_partitions"]

PARTITIONS_WAIT_S = 30.0  # how long a topic may take to show partitions after it was created


def connection(source: KafkaSettings | Mapping[str, Any]) -> dict[str, Any]:
    """The connection keywords (bootstrap servers, security) of a ``KafkaSettings`` or a copy of a dict."""
    client_kwargs = getattr(source, "client_kwargs", None)
    return dict(client_kwargs() if callable(client_kwargs) else source)


def _servers(conn: Mapping[str, Any]) -> str:
    return str(conn.get("bootstrap_servers"))


def new_producer(source: KafkaSettings | Mapping[str, Any], **config: Any) -> KafkaProducer:
    """A kafka-python producer; ``config`` keywords win over the connection's."""
    conn = connection(source)
    try:
        return KafkaProducer(**{**conn, **config})
    except KafkaError as exc:
        raise BrokerError(f"cannot create a producer for bootstrap_servers={_servers(conn)!r}: "
                          f"{diagnose(_servers(conn), connection=conn)}: {exc}") from exc


class Consumer(KafkaConsumer):
    """kafka-python's consumer, except that a poll the cluster refuses (a topic or group this principal may
    not read) raises ``AccessDenied`` naming the topics and the principal, not the fetcher's own error."""

    def poll(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().poll(*args, **kwargs)
        except KafkaError as exc:
            if not is_refusal(exc):
                raise
            topics = sorted({tp.topic for tp in self.assignment()} | set(self.subscription() or ()))
            raise refusal(exc, f"reading {', '.join(topics) or 'topics'}", self.config) from exc


def new_consumer(source: KafkaSettings | Mapping[str, Any], *topics: str,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, **config: Any) -> KafkaConsumer:
    """A kafka-python consumer sized for ``max_record_bytes`` (auto-commit off unless ``config`` says)."""
    merged = {**connection(source), "enable_auto_commit": False, **consumer_config(max_record_bytes), **config}
    return Consumer(*topics, **merged)


def group_less_consumer(source: KafkaSettings | Mapping[str, Any], *, client_id: str = "rollout-bus-reader",
                        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, **config: Any) -> KafkaConsumer:
    """A consumer that only assigns and seeks: it joins no group, commits nothing, creates no topic."""
    config = {"group_id": None, "client_id": client_id, "auto_offset_reset": "earliest", **config}
    if "allow_auto_create_topics" in KafkaConsumer.DEFAULT_CONFIG:
        config["allow_auto_create_topics"] = False
    return new_consumer(source, max_record_bytes=max_record_bytes, **config)


def new_admin(source: KafkaSettings | Mapping[str, Any], *, client_id: str = "rollout-bus-admin",
              **config: Any) -> KafkaAdminClient:
    """An admin client; ``BrokerError`` naming the bootstrap servers when the cluster does not answer."""
    conn = connection(source)
    try:
        return KafkaAdminClient(**{**conn, "client_id": client_id, **config})
    except KafkaError as exc:
        raise BrokerError(f"cannot reach the cluster at {_servers(conn)!r}: {diagnose(_servers(conn), connection=conn)}: {exc}") from exc


def _ssl_context(conn: Mapping[str, Any]) -> ssl.SSLContext | None:
    if "SSL" not in str(conn.get("security_protocol", "PLAINTEXT")).upper():
        return None
    context = ssl.create_default_context(cafile=conn.get("ssl_cafile"))
    if conn.get("ssl_certfile"):
        context.load_cert_chain(conn["ssl_certfile"], conn.get("ssl_keyfile"))
    return context


def _aio_security(conn: Mapping[str, Any]) -> dict[str, Any]:
    """kafka-python's security keywords in aiokafka's spelling (PLAINTEXT: none)."""
    protocol = str(conn.get("security_protocol", "PLAINTEXT")).upper()
    if protocol == "PLAINTEXT":
        return {}
    security: dict[str, Any] = {"security_protocol": protocol, "ssl_context": _ssl_context(conn)}
    if protocol.startswith("SASL"):
        security.update(sasl_mechanism=conn.get("sasl_mechanism") or "PLAIN",
                        sasl_plain_username=conn.get("sasl_plain_username"),
                        sasl_plain_password=conn.get("sasl_plain_password"))
    return {k: v for k, v in security.items() if v is not None}


def new_aio_consumer(source: KafkaSettings | Mapping[str, Any], *,
                     max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, **config: Any) -> AIOKafkaConsumer:
    """An aiokafka consumer (auto-commit off, sized for ``max_record_bytes``) with the connection's security."""
    from aiokafka import AIOKafkaConsumer  # the stream stage's client: others never pay for its import

    conn = connection(source)
    return AIOKafkaConsumer(bootstrap_servers=conn["bootstrap_servers"], enable_auto_commit=False,
                            **consumer_config(max_record_bytes), **_aio_security(conn), **config)


def faust_brokers(source: KafkaSettings | Mapping[str, Any]) -> list[str]:
    """The bootstrap servers as Faust's broker URLs."""
    servers = [s.strip() for s in _servers(connection(source)).split(",") if s.strip()]
    return [f"kafka://{s}" for s in servers]


def faust_credentials(source: KafkaSettings | Mapping[str, Any]) -> Any:
    """The connection's SASL/SSL settings as Faust credentials (None for PLAINTEXT)."""
    import faust

    conn = connection(source)
    protocol = str(conn.get("security_protocol", "PLAINTEXT")).upper()
    if protocol == "PLAINTEXT":
        return None
    context = _ssl_context(conn)
    if protocol.startswith("SASL"):
        return faust.SASLCredentials(username=conn.get("sasl_plain_username"),
                                     password=conn.get("sasl_plain_password"),
                                     mechanism=conn.get("sasl_mechanism") or "PLAIN", ssl_context=context)
    return faust.SSLCredentials(context)


def _check_visible(config: Mapping[str, Any], topic: str) -> None:
    """``AccessDenied`` when a principal's request for ``topic`` by name is refused. A cluster with ACLs leaves
    a topic its principal may not DESCRIBE out of the metadata, as if it did not exist (and answers a request by
    name with the same refusal whether it exists or not), so a consumer would otherwise wait for it in vain."""
    if not config.get("sasl_plain_username"):
        return
    conn = {k: v for k, v in config.items() if v is not None and (k == "bootstrap_servers"
                                                                   or k.startswith(("security_", "sasl_", "ssl_")))}
    admin = new_admin(conn, client_id="rollout-bus-topic-check")
    try:
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    if any(t.get("error_code") == 29 for t in described):  # TOPIC_AUTHORIZATION_FAILED
        raise refusal(TopicAuthorizationFailedError(topic), f"looking up {topic}", conn)


def wait_for_partitions(client: KafkaConsumer | KafkaProducer, topic: str, *,
                        timeout_s: float = PARTITIONS_WAIT_S) -> list[int]:
    """The topic's partitions, waiting up to ``timeout_s`` for them to appear in the metadata;
    ``MissingTopicError`` naming the topic after that, ``AccessDenied`` at once when the principal may not
    see it (``_check_visible``). A retriable error of the metadata request (a broker that is down but still in
    the cached metadata refuses the connection until the cluster drops it) is waited out the same way, and a
    ``BrokerError`` names the last one at the deadline."""
    deadline = time.monotonic() + timeout_s
    asked = False
    while True:
        found, failed = None, None  # failed: this try's retriable error (KafkaError | None)
        try:
            if isinstance(client, KafkaProducer):
                with refusals_named(f"looking up {topic}", client.config):
                    found = client.partitions_for(topic)
            else:
                found = client.partitions_for_topic(topic)
                if not found:
                    if not asked:
                        asked = True
                        _check_visible(client.config, topic)
                    client.topics()  # refreshes the cluster metadata
        except KafkaError as exc:
            if not exc.retriable:
                raise
            failed = exc
        if found:
            return sorted(found)
        if time.monotonic() >= deadline:
            if failed is not None:
                raise BrokerError(f"looking up topic {topic!r}: the cluster's metadata did not answer for "
                                  f"{timeout_s:.0f}s; last error: {failed!r}") from failed
            raise MissingTopicError(f"topic {topic!r} has no partitions in the cluster's metadata after "
                                    f"{timeout_s:.0f}s (a wrong name, or the topic was never created)")
        time.sleep(0.2)
