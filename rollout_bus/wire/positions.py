"""Where to read: ``TOPIC:PARTITION:OFFSET`` positions and offset ranges (``rollout_bus.kafka.reader`` reads them).

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
* ``PartitionRange(topic, partition, start, stop)``: offsets ``[start, stop)`` of one partition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout_bus.errors import ConfigError, must_be

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
KINDS = ("turns", "episodes", "metrics", "shards", "dlq")


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
