"""The shard writer's dead letters: a record it cannot use goes to rollout.dlq, by reference when too large.

Contract:

* ``DeadLetters(outbox, topics, counts).send(key, value, headers, partition, offset, reason, kind)``
  sends a ``DeadLetter`` (stage ``shards``, ``dlq.source`` the record's place on rollout.episodes)
  through the writer's ``delivery.Outbox`` (confirmed before any offset is committed past it),
  logs one WARNING line and counts it in ``counts.dead_letters``.
* A copy the producer or the broker refuses for its size goes by reference instead: same key and
  headers, value null, kind ``too_large``, the reason giving the original's size and
  ``dlq.source`` (where the original stays), then the first reason; counted in
  ``counts.dead_letters_by_reference``. Never fatal.
* ``lost(partition, first, count, log_start)``: records deleted before the writer read them, one
  ``lost`` letter per range (no original to copy), one ERROR line, counted in ``counts.records_lost``.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from rollout_bus.kafka.retry import describe
from rollout_bus.consumers.shard_writer.delivery import Outbox, Outgoing
from rollout_bus.wire.dead_letter import DeadLetter, DlqKind, DlqStage, lost_letter, source_of
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

STAGE = DlqStage.SHARDS


class DeadLetterCounts(Protocol):
    dead_letters: int
    dead_letters_by_reference: int
    records_lost: int


class DeadLetters:
    """Sends the writer's dead letters (see the module docstring)."""

    def __init__(self, outbox: Outbox, topics: Topics, counts: DeadLetterCounts) -> None:
        self.outbox = outbox
        self.topics = topics
        self.counts = counts

    def send(self, key: Any, value: Any, headers: Any, partition: int, offset: int, reason: str, kind: str) -> None:
        letter = DeadLetter(key, value, [(k, bytes(v or b"")) for k, v in (headers or [])], reason, STAGE, kind,
                            source_of(self.topics.episodes, partition, offset))
        self.outbox.send(Outgoing(self.topics.dlq, letter.key, letter.value, letter.record_headers(),
                                  f"dead letter ({kind})"),
                         too_large=lambda record, exc: self._by_reference(letter, exc))
        self.counts.dead_letters += 1
        logger.warning("dead-lettered kind=%s partition=%d offset=%d reason=%s", kind, partition, offset, reason)

    def lost(self, partition: int, first: int, count: int, log_start: int) -> None:
        """Records of rollout.episodes deleted before the writer read them: one ERROR line and one ``lost``
        letter naming the range (``dead_letter.lost_letter``), counted in ``counts.records_lost``."""
        letter = lost_letter(STAGE, self.topics.episodes, partition, first, count, log_start)
        self.outbox.send(Outgoing(self.topics.dlq, letter.key, None, letter.record_headers(), "dead letter (lost)"))
        self.counts.dead_letters += 1
        self.counts.records_lost += count
        logger.error("LOST %s", letter.reason)

    def _by_reference(self, letter: DeadLetter, exc: BaseException) -> Outgoing:
        """The dead letter without its value: too large to copy, the original stays at ``dlq.source``."""
        size = len(letter.value or b"")
        reason = (f"too large to copy ({size} bytes: {describe(exc)}); the original is at {letter.source}; "
                  f"{letter.kind}: {letter.reason}")
        ref = DeadLetter(letter.key, None, letter.headers, reason, STAGE, DlqKind.TOO_LARGE, letter.source)
        self.counts.dead_letters_by_reference += 1
        logger.warning("dead letter of source=%s too large to copy (%d bytes): sent by reference", letter.source,
                       size)
        key = ref.key if ref.key is not None else b""  # Kafka needs a key or a value
        return Outgoing(self.topics.dlq, key, None, ref.record_headers(), "dead letter by reference")
