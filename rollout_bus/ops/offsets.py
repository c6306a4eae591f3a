"""Where to read: ``TOPIC:PARTITION:OFFSET`` positions, and a reader for offset ranges that disturbs nobody.

Contract:

* ``parse_position(text)`` parses exactly ``TOPIC:PARTITION:OFFSET`` (one record, for ``inspect``).
* ``parse_range_start(text)`` parses a ``replay --from`` value: ``TOPIC:PARTITION:OFFSET``,
  ``TOPIC:PARTITION`` (that partition from its first offset) or ``TOPIC`` (every partition from
  its first offset). "First offset" is the partition's earliest available one: 0 unless retention
  deleted records. Topic names follow Kafka's rules (``[A-Za-z0-9._-]``, at most 249 characters),
  so ``:`` never occurs in one and a prefixed name (``run42.rollout.episodes``) parses whole.
  Anything else raises ``ConfigError`` naming the value and what was expected.
* ``topic_kind(topic)`` names the pipeline topic a (possibly prefixed) name ends with
  (``turns``, ``episodes``, ``metrics``, ``shards``, ``dlq``), else None; ``topic_prefix`` is the rest.
* ``open_reader(client_kwargs)`` is a consumer with ``group_id=None`` and auto-commit off: it is
  assigned partitions and seeks, so it joins no group and commits nothing.
* ``resolve_ranges(consumer, starts, to=None)`` turns the starts into ``PartitionRange``s against
  the end offsets at that moment. ``to`` is EXCLUSIVE (Kafka's end offsets are, too) and applies
  to every range; None means the end offset at start. A start before the earliest offset or past
  the end, or ``to`` below the start, raises ``ConfigError``. Records produced later are not read.
* ``read_ranges(consumer, ranges)`` yields every record of the ranges (per partition in offset
  order; partitions interleave as the broker returns them) and stops once each partition's
  position reaches its stop. ``fetch_record(client_kwargs, position)`` returns the one record at
  a position; ``ConfigError`` when the offset is out of range or holds no record.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from rollout_bus.errors import BrokerError, ConfigError, must_be

logger = logging.getLogger(__name__)

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
KINDS = ("turns", "episodes", "metrics", "shards", "dlq")
METADATA_WAIT_S = 3.0
STALL_S = 30.0
POLL_MS = 500


@dataclass(frozen=True)
class Position:
    """One record's address."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}:{self.partition}:{self.offset}"


@dataclass(frozen=True)
class RangeStart:
    """A ``--from`` value: a topic, optionally one partition, optionally a first offset."""

    topic: str
    partition: int | None = None  # None: every partition
    offset: int | None = None  # None: the earliest available offset


@dataclass(frozen=True)
class PartitionRange:
    """Offsets ``[start, stop)`` of one partition."""

    topic: str
    partition: int
    start: int
    stop: int

    @property
    def records(self) -> int:
        return max(0, self.stop - self.start)

    def __str__(self) -> str:
        return f"{self.topic}:{self.partition}:[{self.start},{self.stop})"


def _topic(text: str, whole: str, expected: str) -> str:
    if not _TOPIC_RE.match(text):
        raise ConfigError(must_be("topic", f"a Kafka topic name ([A-Za-z0-9._-]) in {expected}", whole))
    return text


def _number(text: str, name: str, whole: str, expected: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ConfigError(must_be(name, f"a decimal integer >= 0 in {expected}", whole))
    return int(text)


def parse_position(text: str) -> Position:
    """``TOPIC:PARTITION:OFFSET`` -> ``Position``; ConfigError otherwise."""
    expected = "TOPIC:PARTITION:OFFSET"
    parts = str(text).split(":")
    if len(parts) != 3:
        raise ConfigError(must_be("position", expected, text))
    topic, partition, offset = parts
    return Position(_topic(topic, text, expected), _number(partition, "partition", text, expected),
                    _number(offset, "offset", text, expected))


def parse_range_start(text: str) -> RangeStart:
    """``TOPIC[:PARTITION[:OFFSET]]`` -> ``RangeStart``; ConfigError otherwise."""
    expected = "TOPIC, TOPIC:PARTITION or TOPIC:PARTITION:OFFSET"
    parts = str(text).split(":")
    if not 1 <= len(parts) <= 3:
        raise ConfigError(must_be("--from", expected, text))
    topic = _topic(parts[0], text, expected)
    partition = _number(parts[1], "partition", text, expected) if len(parts) > 1 else None
    offset = _number(parts[2], "offset", text, expected) if len(parts) > 2 else None
    return RangeStart(topic, partition, offset)


def topic_kind(topic: str) -> str | None:
    """Which pipeline topic a (possibly prefixed) name is: ``turns``, ``episodes``, ... or None."""
    for kind in KINDS:
        if topic.endswith(f"rollout.{kind}"):
            return kind
    return None


def topic_prefix(topic: str) -> str:
    """The run prefix of a pipeline topic name (``run42.`` of ``run42.rollout.episodes``)."""
    kind = topic_kind(topic)
    return topic[: -len(f"rollout.{kind}")] if kind else ""


def with_prefix(topic: str, prefix: str | None) -> str:
    """A short name (``rollout.episodes``) under ``prefix``; a name already prefixed stays as it is."""
    if not prefix or topic.startswith(prefix):
        return topic
    return f"{prefix}{topic}"


def open_reader(client_kwargs: dict[str, Any]) -> KafkaConsumer:
    """A consumer that only assigns and seeks: no group, no commits."""
    config = {"group_id": None, "enable_auto_commit": False, "auto_offset_reset": "none", "client_id": "rollout-bus-ops"}
    if "allow_auto_create_topics" in KafkaConsumer.DEFAULT_CONFIG:  # reading must never create a topic
        config["allow_auto_create_topics"] = False
    return KafkaConsumer(**client_kwargs, **config)


def partitions_of(consumer: KafkaConsumer, topic: str, timeout_s: float = METADATA_WAIT_S) -> list[int]:
    """The topic's partitions; ConfigError when it does not exist."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = consumer.partitions_for_topic(topic)
        if found:
            return sorted(found)
        if time.monotonic() > deadline:
            raise ConfigError(must_be("topic", "an existing topic with partitions", topic))
        consumer.topics()  # refresh the metadata
        time.sleep(0.2)


def _bounds(consumer: KafkaConsumer, tps: list[TopicPartition]) -> tuple[dict, dict]:
    return consumer.beginning_offsets(tps), consumer.end_offsets(tps)


def resolve_ranges(consumer: KafkaConsumer, starts: Sequence[RangeStart], to: int | None = None) -> list[PartitionRange]:
    """Concrete ``[start, stop)`` ranges for the ``--from`` values (see the module docstring)."""
    if to is not None and (isinstance(to, bool) or to < 0):
        raise ConfigError(must_be("--to", "an offset >= 0", to))
    wanted: dict[TopicPartition, int | None] = {}
    for start in starts:
        known = partitions_of(consumer, start.topic)
        if start.partition is not None and start.partition not in known:
            raise ConfigError(must_be("partition", f"one of {known} of topic {start.topic!r}", start.partition))
        for p in known if start.partition is None else [start.partition]:
            tp = TopicPartition(start.topic, p)
            if tp in wanted:
                raise ConfigError(f"--from names {start.topic}:{p} twice")
            wanted[tp] = start.offset
    begins, ends = _bounds(consumer, list(wanted))
    ranges = []
    for tp, offset in wanted.items():
        first = begins[tp] if offset is None else offset
        if not begins[tp] <= first <= ends[tp]:
            raise ConfigError(must_be("offset", f"in [{begins[tp]}, {ends[tp]}] (the offsets of "
                                                f"{tp.topic}:{tp.partition})", first))
        stop = ends[tp] if to is None else min(to, ends[tp])
        if stop < first:
            raise ConfigError(must_be("--to", f">= the start offset {first} of {tp.topic}:{tp.partition}", to))
        ranges.append(PartitionRange(tp.topic, tp.partition, first, stop))
    return sorted(ranges, key=lambda r: (r.topic, r.partition))


def read_ranges(consumer: KafkaConsumer, ranges: Iterable[PartitionRange],
                on_record: Callable[[Any], None] | None = None) -> Iterator[Any]:
    """Every record of the ranges; BrokerError when reading stalls for ``STALL_S``."""
    todo = {TopicPartition(r.topic, r.partition): r for r in ranges if r.records > 0}
    if not todo:
        return
    consumer.assign(list(todo))
    for tp, r in todo.items():
        consumer.seek(tp, r.start)
    last_progress = time.monotonic()
    while todo:
        polled = consumer.poll(timeout_ms=POLL_MS, max_records=2000)
        for tp, records in polled.items():
            r = todo.get(tp)
            for record in records:
                if r is not None and r.start <= record.offset < r.stop:
                    if on_record is not None:
                        on_record(record)
                    yield record
        if polled:
            last_progress = time.monotonic()
        for tp in [tp for tp, r in todo.items() if consumer.position(tp) >= r.stop]:
            consumer.pause(tp)
            del todo[tp]
        if todo and time.monotonic() - last_progress > STALL_S:
            raise BrokerError(f"no records for {STALL_S:.0f}s while reading {', '.join(map(str, todo.values()))}")


def fetch_record(client_kwargs: dict[str, Any], position: Position) -> Any:
    """The record at ``position``; ConfigError when the offset is out of range or holds none."""
    consumer = open_reader(client_kwargs)
    try:
        known = partitions_of(consumer, position.topic)
        if position.partition not in known:
            raise ConfigError(must_be("partition", f"one of {known} of topic {position.topic!r}", position.partition,
                                      where=str(position)))
        tp = TopicPartition(position.topic, position.partition)
        begins, ends = _bounds(consumer, [tp])
        if not begins[tp] <= position.offset < ends[tp]:
            raise ConfigError(must_be("offset", f"in [{begins[tp]}, {ends[tp]}) (the records of "
                                                f"{position.topic}:{position.partition})", position.offset,
                                      where=str(position)))
        span = PartitionRange(position.topic, position.partition, position.offset, position.offset + 1)
        for record in read_ranges(consumer, [span]):
            return record
        raise ConfigError(f"no record at {position} (a compacted or transactional gap)")
    finally:
        consumer.close()
