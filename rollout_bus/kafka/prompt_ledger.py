"""rollout.prompt_ledger read and written: what became of every prompt group, the log a generator group decides on.

Why in the kafka layer: the ledger is how generators that never talk to each other agree on a prompt group's
deliveries and end (``rollout_bus.wire.prompt_record``). Reading it is an assign-and-seek over every partition
(no group, nothing committed), writing it a durable producer whose every event is acknowledged before the caller
goes on, so an event the caller acted on is in the log.

Contract:

* ``LedgerLog(conn, topics)``: ``catch_up()`` reads every partition up to the end offsets it had when called
  and folds the events into ``ledger`` (a ``PromptLedger``); an event that does not parse is logged once and
  skipped (it names the offset). ``write(event)`` sends one event and waits for its acknowledgement
  (``BrokerError`` if it fails); the event is folded in at once (a ``loaded`` count only when read back).
  ``send(topic, key, value, headers)``: another record (a dead letter) the same way. ``note(event)``: a
  ``progress`` event sent without waiting (thread-safe; from a producer callback too): one that is lost costs only
  the turn it marks being made again by a later delivery, so none holds a turn back. ``close()`` flushes them.
* ``read_ledger(conn, topics)``: the ledger as it is now (a ``LedgerLog`` caught up once, then closed).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rollout_bus.errors import BrokerError, ContractError
from rollout_bus.kafka.clients import KafkaError, TopicPartition, group_less_consumer, new_producer, wait_for_partitions
from rollout_bus.wire.prompt_record import LedgerEvent, PromptLedger
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

ACK_TIMEOUT_S = 120.0
CATCH_UP_POLL_MS = 200
OFFSETS_TIMEOUT_MS = 30_000  # every offsets request bounded: kafka-python 3 was seen to block without one


class LedgerLog:
    """The prompt ledger, read to the end on demand and written event by event (see the module docstring)."""

    def __init__(self, conn: Mapping[str, Any], topics: Topics, *, client_id: str = "rollout-bus-ledger") -> None:
        self.topic = topics.prompt_ledger
        self.ledger = PromptLedger()
        self._consumer = group_less_consumer(conn, client_id=client_id)
        try:
            partitions = wait_for_partitions(self._consumer, self.topic)
            self._partitions = [TopicPartition(self.topic, p) for p in partitions]
            self._consumer.assign(self._partitions)
            self._consumer.seek_to_beginning(*self._partitions)
            self._producer = new_producer(conn, acks="all", enable_idempotence=True, client_id=client_id, linger_ms=0)
        except BaseException:
            self._consumer.close()
            raise

    def catch_up(self) -> PromptLedger:
        """Read every event up to the end offsets as they are now; return the folded ledger."""
        try:
            ends = self._consumer.end_offsets(self._partitions, timeout_ms=OFFSETS_TIMEOUT_MS)
            while any(self._consumer.position(tp, timeout_ms=OFFSETS_TIMEOUT_MS) < end for tp, end in ends.items()):
                for records in self._consumer.poll(timeout_ms=CATCH_UP_POLL_MS).values():
                    for record in records:
                        self._take(record)
        except KafkaError as exc:
            raise BrokerError(f"cannot read {self.topic}: {exc}") from exc
        return self.ledger

    def _take(self, record: Any) -> None:
        try:
            self.ledger.take(LedgerEvent.from_value(record.value))
        except ContractError as exc:
            logger.warning("skipping a ledger record that does not parse topic=%s partition=%d offset=%d: %s",
                           record.topic, record.partition, record.offset, exc)

    def write(self, event: LedgerEvent) -> None:
        """Send ``event`` and wait until the cluster has it; fold it in."""
        try:
            self._producer.send(self.topic, key=event.key(), value=event.value(),
                                headers=event.headers()).get(timeout=ACK_TIMEOUT_S)
        except KafkaError as exc:
            raise BrokerError(f"cannot write the {event.event} event of prompt group {event.prompt!r} to "
                              f"{self.topic}: {exc}") from exc
        if event.event != "loaded":  # the others fold in idempotently when they are read back; a count would not
            self.ledger.take(event)

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> None:
        """Send one other record (a dead letter) on the ledger's producer and wait until the cluster has it."""
        try:
            self._producer.send(topic, key=key, value=value, headers=headers).get(timeout=ACK_TIMEOUT_S)
        except KafkaError as exc:
            raise BrokerError(f"cannot write to {topic}: {exc}") from exc

    def note(self, event: LedgerEvent) -> None:
        """Send ``event`` without waiting for it (see the module docstring); a failure is logged."""
        def failed(exc: BaseException) -> None:
            logger.warning("a %s event of prompt group %r was not written to %s (%s): a later delivery makes that "
                           "turn again", event.event, event.prompt, self.topic, exc)
        try:
            self._producer.send(self.topic, key=event.key(), value=event.value(),
                                headers=event.headers()).add_errback(failed)
        except KafkaError as exc:
            failed(exc)

    def close(self) -> None:
        try:
            self._producer.flush(timeout=ACK_TIMEOUT_S)
        except KafkaError as exc:
            logger.warning("progress events of %s not all flushed: %s", self.topic, exc)
        try:
            self._producer.close()
        finally:
            self._consumer.close()


def read_ledger(conn: Mapping[str, Any], topics: Topics) -> PromptLedger:
    """The prompt ledger as the log has it now."""
    log = LedgerLog(conn, topics)
    try:
        return log.catch_up()
    finally:
        log.close()
