"""rollout.episodes as the shard writer reads it: one consumer, every partition, and no record skipped in silence.

Why a module of its own: where the writer stands on each partition is its own concern, apart from what it
does with the records (``rollout_bus.consumers.shard_writer.writer``): opening at the group's committed
offsets, telling a record deleted before it was read from a jump the log explains, the lag, a partition
count raised under it, and the commit.

Contract:

* ``EpisodesReader.open(conn, topic, group_id=, max_record_bytes=, retry=, letters=)`` connects a
  kafka-python consumer (``enable_auto_commit=False``; the group id only stores offsets), assigns it
  every partition of ``topic`` (waiting for the topic) and resolves each partition's committed offset
  (0 if none) and position before the loop starts. Every Kafka operation goes through the writer's
  ``retry`` (``rollout_bus.kafka.retry.retrying``): broker outages are ridden out.
* Lost records: the offset each partition should hand over next is the committed one at start, then the
  one after each record ``took``. When the consumer lands past it and the log now starts past it, the
  offsets from it up to the log start are lost: one ``lost`` dead letter per range (``letters.lost``,
  which logs the ERROR). A jump for any other reason (a transaction marker) is not.
  Each range is also kept in ``lost`` (``lost_markers.LostRange``, in the order found), for the writer's
  end-of-run decision when the end-of-run markers may have been among them.
* ``lag()``: records of the topic not read yet. ``check_partitions()`` raises ``PartitionsChangedError``
  when the topic now has more partitions than are assigned (records on the new ones would never be
  read; the caller exits to be restarted). ``commit({partition: offset})`` commits those offsets.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rollout_bus.consumers.shard_writer.dead_letters import DeadLetters
from rollout_bus.consumers.shard_writer.lost_markers import LostRange
from rollout_bus.consumers.shard_writer.recovery import Retry
from rollout_bus.errors import PartitionsChangedError
from rollout_bus.kafka.clients import (KafkaConsumer, OffsetAndMetadata, TopicPartition, new_consumer,
                                       wait_for_partitions)

logger = logging.getLogger(__name__)

__all__ = ["EpisodesReader"]

POLL_TIMEOUT_MS = 200
OFFSETS_TIMEOUT_MS = 10_000


class EpisodesReader:
    """The writer's consumer of rollout.episodes, with the offset each partition should hand over next."""

    def __init__(self, consumer: KafkaConsumer, topic: str, retry: Retry, letters: DeadLetters) -> None:
        self.consumer = consumer
        self.topic = topic
        self.partitions: list[int] = []
        self._retry = retry
        self._letters = letters
        self._expected: dict[int, int] = {}  # the next offset each partition should hand over (a jump: lost?)
        self.lost: list[LostRange] = []  # every range found deleted unread, in the order found

    @classmethod
    def open(cls, client_kwargs: Mapping[str, Any], topic: str, *, group_id: str, max_record_bytes: int,
             retry: Retry, letters: DeadLetters) -> EpisodesReader:
        consumer = retry(lambda: new_consumer(client_kwargs, max_record_bytes=max_record_bytes, group_id=group_id,
                                              auto_offset_reset="earliest", max_poll_records=500),
                         "connect the consumer")
        reader = cls(consumer, topic, retry, letters)
        reader._assign()
        return reader

    def _assign(self) -> None:
        def found() -> list[TopicPartition]:  # MissingTopicError is Unavailable: retried
            return [TopicPartition(self.topic, p)
                    for p in wait_for_partitions(self.consumer, self.topic, timeout_s=1.0)]
        partitions = self._retry(found, f"the partitions of {self.topic}")
        self.consumer.assign(partitions)
        self.partitions = [tp.partition for tp in partitions]
        for tp in partitions:  # resolves committed offsets (or earliest) before the idle clock starts
            committed = self._retry(lambda: self.consumer.committed(tp, timeout_ms=OFFSETS_TIMEOUT_MS),
                                    f"the committed offset of {tp.topic}:{tp.partition}")
            position = self._retry(lambda: self.consumer.position(tp, timeout_ms=OFFSETS_TIMEOUT_MS),
                                   f"the position on {tp.topic}:{tp.partition}")
            logger.info("reading topic=%s partition=%d offset=%d", tp.topic, tp.partition, position)
            # the group's own record of where it was (0: it never read the topic); the consumer resets a
            # position the log no longer holds to the log start without a word
            self._expected[tp.partition] = committed if committed is not None else 0
            self._check_lost(tp, position)

    def poll(self) -> dict[TopicPartition, list[Any]]:
        return self._retry(lambda: self.consumer.poll(timeout_ms=POLL_TIMEOUT_MS), "poll rollout.episodes")

    def took(self, record: Any) -> None:
        """A record handed over: offsets skipped before it checked for loss, the next one expected after it."""
        self._check_lost(TopicPartition(record.topic, record.partition), record.offset)
        self._expected[record.partition] = record.offset + 1

    def _check_lost(self, tp: TopicPartition, reached: int) -> None:
        """Offsets from the expected one up to ``reached`` that the log no longer holds are lost: said
        once, dead-lettered as ``lost`` (a jump for any other reason, a transaction marker, is not)."""
        expected = self._expected.get(tp.partition)
        if expected is None or reached <= expected:
            return
        log_start = self._retry(lambda: self.consumer.beginning_offsets([tp], timeout_ms=OFFSETS_TIMEOUT_MS)[tp],
                                f"the log start of {tp.topic}:{tp.partition}")
        if log_start > expected:
            count = min(log_start, reached) - expected
            self._letters.lost(tp.partition, expected, count, log_start)
            self.lost.append(LostRange(tp.topic, tp.partition, expected, count))
        self._expected[tp.partition] = reached

    def lag(self) -> int:
        """Records on rollout.episodes not read yet (for the progress line and ``exit_when_idle``)."""
        partitions = list(self.consumer.assignment())
        ends = self._retry(lambda: self.consumer.end_offsets(partitions, timeout_ms=OFFSETS_TIMEOUT_MS),
                           "the end offsets of rollout.episodes")
        return sum(max(0, end - self._retry(lambda: self.consumer.position(tp, timeout_ms=OFFSETS_TIMEOUT_MS),
                                            "the position on rollout.episodes")) for tp, end in ends.items())

    def check_partitions(self) -> None:
        """rollout.episodes raised under the writer: its new partitions would never be read, so stop (the
        caller exits 75 and a supervisor restarts the writer, which assigns them all; what it wrote and committed
        stays, the new partitions are read from their start)."""
        self._retry(self.consumer.topics, "the metadata of the cluster")  # always a fresh metadata request
        now = len(self.consumer.partitions_for_topic(self.topic) or ())
        assigned = len(self.consumer.assignment())
        if now > assigned:
            raise PartitionsChangedError(f"topic={self.topic} now has {now} partitions, this writer reads "
                                         f"{assigned}: records on the new partitions would never be read; exiting "
                                         f"to be restarted with the new count")

    def commit(self, offsets: Mapping[int, int]) -> None:
        """Commit ``{partition: offset}`` for the group."""
        committed = {TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()}
        self._retry(lambda: self.consumer.commit(committed), "commit offsets")

    def close(self) -> None:
        self.consumer.close(autocommit=False)
