"""``TurnPublisher``: one turn sample per rollout.turns record, on a kafka-python producer.

Contract (PIPELINE.md, rollout.turns):

* Key: ``rollout_key_string(get_rollout_key(sample, 0))``, so all turns of an episode land on one
  partition in order. Value: ``encode_samples([sample], TURN_FIELDS)``. Headers:
  ``TurnHeaders(...).to_kafka()`` with ``sent_at`` the wall clock in milliseconds.
* Refused before anything is sent (``ContractError`` naming the reason, the rollout key and the
  turn): a sample that fails ``validate()``, and a sample with no ``rollout_id``, ``index`` or
  ``group_index`` identity (its key would be a batch position, meaningless across records).
* Durable and ordered: ``acks="all"``, ``enable_idempotence=True`` (retries never duplicate or
  reorder), ``linger_ms=5``, and compression ``lz4`` when the ``lz4`` package is installed, else
  ``gzip`` (the only codec kafka-python supports with no extra package; zstd and snappy need
  one). Any of these, and SASL/SSL settings, can be given in ``kafka_config``; extra keywords pass
  straight to ``KafkaProducer``.
* Failures are never swallowed: a record whose delivery fails is remembered, and the next
  ``publish_turn``, ``flush`` or ``close`` raises ``BrokerError`` saying how many failed and why;
  the future returned by ``publish_turn`` fails too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kafka import KafkaProducer
from kafka.codec import has_lz4
from kafka.errors import KafkaError

from rollout_bus.codec import encode_samples
from rollout_bus.errors import BrokerError, ContractError
from rollout_bus.metrics import get_rollout_key
from rollout_bus.records import TURN_FIELDS, TurnHeaders
from rollout_bus.sample import Sample
from rollout_bus.topics import rollout_key_string

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = "rollout.turns"
LINGER_MS = 5
BATCH_BYTES = 1 << 20  # a realistic turn is 5-250 kB: the 16 kB default would send one record per request


def default_compression() -> str:
    """``lz4`` when its package is installed, else ``gzip`` (always available)."""
    return "lz4" if has_lz4() else "gzip"


def producer_defaults() -> dict[str, Any]:
    """The producer settings every turn publisher starts from (durable, ordered, batched, compressed)."""
    return {"acks": "all", "enable_idempotence": True, "compression_type": default_compression(),
            "linger_ms": LINGER_MS, "batch_size": BATCH_BYTES, "max_request_size": 8 * BATCH_BYTES,
            "client_id": "rollout-bus-generator"}


class TurnPublisher:
    """Publishes per-turn samples to rollout.turns; use as a context manager or call ``close()``."""

    def __init__(self, bootstrap_servers: str | list[str], topic: str = DEFAULT_TOPIC, **kafka_config: Any) -> None:
        config = producer_defaults()
        config.update(kafka_config)
        self.topic = topic
        self.records_sent = 0
        self.bytes_sent = 0
        self._failures: list[BaseException] = []
        self._failed_count = 0
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._producer = KafkaProducer(bootstrap_servers=bootstrap_servers, **config)
        except KafkaError as exc:
            raise BrokerError(f"cannot create a producer for bootstrap_servers={bootstrap_servers!r}: {exc}") from exc
        logger.info("publisher ready topic=%s compression=%s", topic, config["compression_type"])

    def publish_turn(self, sample: Sample, *, turn: int, final: bool, attempt: int = 0, group_size: int):
        """Send one turn; returns kafka-python's future (``.get()`` gives the record metadata)."""
        key = self._checked_key(sample, turn)
        try:
            value = encode_samples([sample], TURN_FIELDS)
        except ValueError as exc:
            raise ContractError(f"refusing turn={turn} of rollout key={key.decode()}: {exc}") from exc
        headers = TurnHeaders(turn=turn, attempt=attempt, final=bool(final), group_size=group_size,
                              sent_at_ms=time.time_ns() // 1_000_000)
        return self.send_raw(key, value, headers.to_kafka())

    def send_raw(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]):
        """Send bytes as they are, with no checks (the generator's deliberate faults use this)."""
        self._raise_failures()
        if self._closed:
            raise BrokerError(f"publisher for topic={self.topic} is closed")
        try:
            future = self._producer.send(self.topic, key=key, value=value, headers=headers)
        except KafkaError as exc:
            raise BrokerError(f"cannot send to topic={self.topic}: {exc}") from exc
        future.add_errback(self._on_failure)
        self.records_sent += 1
        self.bytes_sent += len(value) + (len(key) if key else 0)
        return future

    def _checked_key(self, sample: Sample, turn: int) -> bytes:
        rollout_key = get_rollout_key(sample, 0)
        key = rollout_key_string(rollout_key)
        if rollout_key[1] == "position":
            raise ContractError(f"refusing turn={turn} of rollout key={key}: the sample has no rollout_id, index "
                                "or group_index identity, and a position key means nothing across records")
        try:
            sample.validate()
        except ValueError as exc:
            raise ContractError(f"refusing turn={turn} of rollout key={key}: {exc}") from exc
        return key.encode()

    def _on_failure(self, exc: BaseException) -> None:
        """Runs on the producer's I/O thread."""
        with self._lock:
            self._failed_count += 1
            if len(self._failures) < 5:
                self._failures.append(exc)
        logger.error("delivery failed topic=%s error=%s", self.topic, exc)

    def _raise_failures(self) -> None:
        with self._lock:
            count, failures = self._failed_count, list(self._failures)
            self._failed_count, self._failures = 0, []
        if count:
            reasons = "; ".join(f"{type(e).__name__}: {e}" for e in failures)
            raise BrokerError(f"{count} record(s) to topic={self.topic} failed delivery: {reasons}") from failures[0]

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record sent so far is acknowledged; raise if any failed."""
        try:
            self._producer.flush(timeout=timeout)
        except KafkaError as exc:
            raise BrokerError(f"flush of topic={self.topic} did not complete: {exc}") from exc
        self._raise_failures()

    def close(self, timeout: float | None = None) -> None:
        """Flush, then release the producer; raises if a record failed (after releasing)."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            self._producer.close(timeout=timeout)

    def __enter__(self) -> TurnPublisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # the body's exception is the one to report
            logger.exception("close after an error also failed topic=%s", self.topic)
