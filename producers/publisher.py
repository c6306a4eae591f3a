"""``TurnPublisher``: one turn sample per rollout.turns record, on a kafka-python producer.

Contract (docs/pipeline.md section 2; the record byte for byte: WIRE.md section 4):

* Key: ``rollout_key_of(sample)``, so all turns of an episode land on one
  partition in order. Value: ``encode_samples([sample], TURN_FIELDS)``. Headers:
  ``TurnHeaders(...).to_kafka()`` with ``sent_at`` the wall clock in milliseconds, and ``generator`` when
  the publisher was given one (the stream worker refuses a turn for an episode another generator made).
* Refused before anything is sent (``ContractError`` naming the reason, the rollout key and the
  turn): a sample that fails ``validate()``, and a sample with no ``rollout_id``, ``index`` or
  ``group_index`` identity (its key would be a batch position, meaningless across records:
  ``rollout_bus.wire.rollout_key.check_record_key``).
* Refused before anything is sent, too: a turn whose encoded value is over ``max_record_bytes``
  (``ContractError`` naming the rollout key, turn, size and limit). Request sizes follow from the
  same number (``rollout_bus.kafka.limits.producer_config``).
* Durable and ordered: ``acks="all"``, ``enable_idempotence=True`` (retries never duplicate or
  reorder), ``linger_ms=5``, and compression ``lz4`` (``gzip`` when the ``lz4`` package is
  missing). Any of these, and SASL/SSL settings, can be given in ``kafka_config`` and win over
  the defaults; extra keywords pass straight to ``KafkaProducer``.
* Broker outages are ridden out, not failed: every record may wait ``delivery_timeout_s``
  (default 15 min; kafka-python's ``delivery_timeout_ms`` and ``max_block_ms``) inside the
  producer, in order, and is sent when the broker is back. Meanwhile a WARNING line every 10 s
  says what is waiting (``rollout_bus.producers.broker_wait``) and ``on_wait`` is told (the generate progress
  line says "waiting for broker"). At most ``limits.pending_bytes_limit`` bytes (or a
  ``buffer_memory`` keyword) wait at once; past that ``publish_turn`` blocks until the broker
  answers.
* Failures are never swallowed: a record whose delivery fails (an outage longer than the delivery
  timeout included) is remembered, and the next ``publish_turn``, ``flush`` or ``close`` raises
  ``BrokerError`` saying how many failed and why; the future returned by ``publish_turn`` fails too.
* ``publish_end_of_run(run)``: once every record sent before is acknowledged, one ``EndOfRun(run)``
  record (key ``END_OF_RUN_KEY``) to every partition of the topic, then flushed: the stream stage
  forwards it, and the shard writer writes the run's last, partial batch when it has seen them all.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rollout_bus.producers.broker_wait import BrokerWaitWatch, PendingRecords, WaitFn
from rollout_bus.wire.codec import encode_samples
from rollout_bus.errors import BrokerError, ContractError
from rollout_bus.kafka.clients import KafkaError, has_lz4, new_producer, wait_for_partitions
from rollout_bus.kafka.limits import pending_bytes_limit, producer_config
from rollout_bus.kafka.refusals import explain, is_refusal, refusal
from rollout_bus.model.sample import get_rollout_key
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders, check_generator_id
from rollout_bus.model.sample import Sample
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, TURNS_TOPIC
from rollout_bus.wire.rollout_key import check_record_key, rollout_key_string

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = TURNS_TOPIC
LINGER_MS = 5
BATCH_BYTES = 1 << 20  # a realistic turn is 5-250 kB: the 16 kB default would send one record per request
PARTITIONS_CHECK_S = 10.0  # how often the generator looks at the partition count its producer hashes over
DEFAULT_DELIVERY_TIMEOUT_S = 15 * 60.0  # how long a record may wait for the broker (an outage) before it fails


def default_compression() -> str:
    """``lz4`` when its package is installed, else ``gzip`` (always available)."""
    return "lz4" if has_lz4() else "gzip"


def producer_defaults(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                      delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S) -> dict[str, Any]:
    """The producer settings every turn publisher starts from (durable, ordered, batched, compressed,
    sized by ``max_record_bytes``, patient for ``delivery_timeout_s``), as ``KafkaProducer`` keywords."""
    sized = producer_config(max_record_bytes)
    if sized.get("compression_type") == "lz4" and not has_lz4():
        sized["compression_type"] = default_compression()
    timeout_ms = int(delivery_timeout_s * 1000)
    return {"acks": "all", "enable_idempotence": True, "compression_type": default_compression(),
            "linger_ms": LINGER_MS, "batch_size": BATCH_BYTES, "client_id": "rollout-bus-generator",
            "allow_auto_create_topics": False, **sized,
            "delivery_timeout_ms": timeout_ms, "max_block_ms": timeout_ms}


class TurnPublisher:
    """Publishes per-turn samples to rollout.turns; use as a context manager or call ``close()``."""

    def __init__(self, bootstrap_servers: str | list[str], topic: str = DEFAULT_TOPIC, *,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S, on_wait: WaitFn | None = None,
                 generator: str | None = None, **kafka_config: Any) -> None:
        config = producer_defaults(max_record_bytes, delivery_timeout_s)
        config.update(kafka_config)
        # kafka-python 3 has no buffer pool: the publisher bounds what waits (``buffer_memory`` overrides)
        pending_bytes = int(config.pop("buffer_memory", pending_bytes_limit(max_record_bytes)))
        self.topic = topic
        self.generator = check_generator_id(generator) if generator is not None else None
        self.max_record_bytes = max_record_bytes
        self.delivery_timeout_s = delivery_timeout_s
        self.records_sent = 0
        self.bytes_sent = 0
        self._failures: list[BaseException] = []
        self._failed_count = 0
        self._reasons_logged: set[str] = set()  # one ERROR line per distinct reason, not one per record
        self._lock = threading.Lock()
        self._closed = False
        self._pending = PendingRecords()
        self._pending_limit = pending_bytes
        self._producer = new_producer({"bootstrap_servers": bootstrap_servers}, **config)
        self._watch = BrokerWaitWatch(self._pending, topic, on_wait)
        self.partitions: int | None = None  # what the producer hashes keys over, as last seen
        self._partitions_checked = float("-inf")
        logger.info("publisher ready topic=%s compression=%s max_record_bytes=%d delivery_timeout_s=%.0f", topic,
                    config["compression_type"], max_record_bytes, config["delivery_timeout_ms"] / 1000)

    def publish_turn(self, sample: Sample, *, turn: int, final: bool, attempt: int = 0, group_size: int,
                     delivery: int = 0, resumed: bool = False):
        """Send one turn; returns kafka-python's future (``.get()`` gives the record metadata). ``delivery``: the
        prompt group's delivery, for a turn made from rollout.prompts (0: no ``delivery`` header); ``resumed``: the
        first turn a delivery makes of an episode it resumes (the ``resumed`` header)."""
        key = self._checked_key(sample, turn)
        try:
            value = encode_samples([sample], TURN_FIELDS)
        except ValueError as exc:
            raise ContractError(f"refusing turn={turn} of rollout key={key.decode()}: {exc}") from exc
        if len(value) > self.max_record_bytes:
            raise ContractError(f"refusing turn={turn} of rollout key={key.decode()}: its encoded value is "
                                f"{len(value)} bytes, over max_record_bytes={self.max_record_bytes} "
                                "(ROLLOUT_BUS_MAX_RECORD_BYTES)")
        headers = TurnHeaders(turn=turn, attempt=attempt, final=bool(final), group_size=group_size,
                              sent_at_ms=time.time_ns() // 1_000_000, generator=self.generator, delivery=delivery,
                              resumed=resumed)
        return self.send_raw(key, value, headers.to_kafka())

    def send_raw(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]):
        """Send bytes as they are, with no checks (the generator's deliberate faults use this)."""
        future = self._send(key, value, headers)
        self.records_sent += 1
        self.bytes_sent += len(value) + (len(key) if key else 0)
        return future

    def publish_end_of_run(self, run: str) -> int:
        """Close run ``run`` on every partition of the topic, after everything sent before is
        acknowledged; returns the number of partitions. Raises ``BrokerError`` if anything failed.

        Not counted in ``records_sent``/``bytes_sent`` (those count turns and raw records).
        """
        self.flush()
        marker = EndOfRun(run)
        with self._pending.blocked("end-of-run (partition metadata)"):
            try:
                partitions = wait_for_partitions(self._producer, self.topic)
            except KafkaError as exc:
                raise BrokerError(f"cannot find the partitions of topic={self.topic}: {exc}") from exc
        for partition in partitions:
            self._send(END_OF_RUN_KEY, marker.value(), marker.headers(), partition=partition)
        self.flush()
        logger.info("end of run run=%s topic=%s partitions=%d", run, self.topic, len(partitions))
        return len(partitions)

    def _send(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]], partition: int | None = None):
        self._raise_failures()
        if self._closed:
            raise BrokerError(f"publisher for topic={self.topic} is closed")
        size = len(value) + (len(key) if key else 0)
        self._pending.wait_for_room(size, self._pending_limit)
        self._pending.sent(size)  # before send: the broker may answer before send returns
        try:
            with self._pending.blocked("send"):
                future = self._producer.send(self.topic, key=key, value=value, headers=headers, partition=partition)
        except BaseException as exc:
            self._pending.settled(size)
            if isinstance(exc, KafkaError):
                raise BrokerError(f"cannot send to topic={self.topic}: {exc}") from exc
            raise
        future.add_both(self._pending.settled, size)
        future.add_errback(self._on_failure)
        self._watch_partitions()
        return future

    def _watch_partitions(self) -> None:
        """Say when the partition count the producer hashes keys over changes (rollout.turns raised mid-run):
        checked on its cached metadata, at most every ``PARTITIONS_CHECK_S``, so it costs no request."""
        now = time.monotonic()
        if now - self._partitions_checked < PARTITIONS_CHECK_S:
            return
        self._partitions_checked = now
        count = len(self._producer.partitions_for(self.topic) or ())  # the cache the partitioner reads (sent: known)
        if not count:
            return
        if self.partitions is not None and count != self.partitions:
            logger.warning("topic=%s now has %d partitions, %d when this generator started: new turns hash over %d "
                           "(a turn of an episode in progress may land on another partition than its earlier turns; "
                           "the stream workers re-route it)", self.topic, count, self.partitions, count)
        self.partitions = count

    def _checked_key(self, sample: Sample, turn: int) -> bytes:
        rollout_key = get_rollout_key(sample, 0)
        key = rollout_key_string(rollout_key)
        try:
            check_record_key(rollout_key)  # a position key means nothing across records
            sample.validate()
        except ValueError as exc:
            raise ContractError(f"refusing turn={turn} of rollout key={key}: {exc}") from exc
        return key.encode()

    def _on_failure(self, exc: BaseException) -> None:
        """Runs on the producer's I/O thread."""
        reason = explain(exc)
        with self._lock:
            self._failed_count += 1
            if len(self._failures) < 5:
                self._failures.append(exc)
            first = reason not in self._reasons_logged and len(self._reasons_logged) < 5
            self._reasons_logged.add(reason)
        if first:  # a refused topic fails every record in flight: the count comes with the flush's error
            logger.error("delivery failed topic=%s error=%s", self.topic, reason)

    def _raise_failures(self) -> None:
        with self._lock:
            count, failures = self._failed_count, list(self._failures)
            self._failed_count, self._failures = 0, []
        if count:
            if is_refusal(failures[0]):
                raise refusal(failures[0], f"publishing {count} record(s) to topic={self.topic}",
                              self._producer.config) from failures[0]
            reasons = "; ".join(dict.fromkeys(explain(e) for e in failures))  # each reason once
            raise BrokerError(f"{count} record(s) to topic={self.topic} failed delivery: {reasons}") from failures[0]

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record sent so far is acknowledged (or failed: each waits at most the
        delivery timeout); raise if any failed. A WARNING every 10 s while the broker keeps it waiting."""
        try:
            with self._pending.blocked("flush"):
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
            self._watch.close()
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
