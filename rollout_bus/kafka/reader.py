"""Reading topics without a consumer group: assign + seek, nothing committed, no topic created.

Contract:

* ``TopicWatcher(conn, count_topics, read_topics, data_topics=())``: ``counts()`` gives, per counted
  topic, the records ever written (end offsets), except for ``data_topics``: those are read in full
  and only their data records are counted, never control records (a ``control`` header: end-of-run
  markers, abandoned episodes), so an "episodes" count is a count of episodes. Reading costs a
  fetch of every value (kafka-python cannot fetch headers alone): fine for demos and tests, not
  for a production monitor. ``read_topics`` are read and kept (``dead_letters``, ``json_values``).
  ``catch_up()`` reads until every read topic has reached the end offsets it had when called. End offsets
  are asked by a client of their own, and the wait is bounded by ``ENDS_BOUND_S`` (30 s): kafka-python 3's
  ``end_offsets`` once stayed blocked for minutes past its request timeout (a chaos run's watcher, its
  IO thread idle in ``select``), so an answer that does not come is abandoned with a WARNING, the client
  replaced, and the last counts kept (``catch_up`` returns False).
* ``TopicReader(conn, names, history=None)`` reads every partition of ``names`` from the
  beginning, or, with ``history=N``, from the last N records of each partition. ``poll()`` hands
  over the records that arrived since the last call (and forgets them, so a long-running reader
  holds no history); ``read_to_end()`` polls until it has reached the end offsets seen when it was
  called (``BrokerError`` past ``timeout_s``). ``read_to_end(stall_s=S)`` is for a caller that
  retries through broker outages (``rollout_bus.kafka.retry``, as the shard writer reads
  rollout.shards at start-up): no limit on the whole read, only on progress (no record for ``S``
  seconds before the end is ``Unavailable``, transient), and every offset request is bounded by
  ``S``, so an outage never blocks it. ``record_counts(names)`` gives the records ever written to
  any topics. A reader that fails while it looks its topics up closes its consumer (a retry leaks none).
  ``read_topic(conn, topic, stall_s=S)`` is that read with a reader of its own, for a caller's retry.
* ``topic_names(conn)``: every topic on the cluster.
* Offset ranges (``rollout_bus.wire.positions``): ``resolve_ranges(consumer, starts, to=None)`` turns
  ``RangeStart``s into ``PartitionRange``s against the end offsets at that moment (``to`` is
  EXCLUSIVE, applies to every range; None means the end offset at start; a start before the
  earliest offset or past the end, or ``to`` below the start, raises ``ConfigError``; records
  produced later are not read). ``read_ranges(consumer, ranges)`` yields every record of the
  ranges (per partition in offset order) and stops once each partition reaches its stop.
  ``fetch_record(conn, position)`` returns the one record at a position; ``ConfigError`` when the
  offset is out of range or holds no record. ``fetch_records(conn, topic, offsets)`` returns the records at many
  offsets (``{partition: offsets}``), each partition read once over the span of its offsets; an offset the log no
  longer holds (retention, a deleted topic) is absent from the answer, for the caller to report.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.errors import BrokerError, ConfigError, Unavailable, must_be
from rollout_bus.kafka.clients import (KafkaConsumer, KafkaError, TopicPartition, group_less_consumer,
                                       wait_for_partitions)
from rollout_bus.wire.positions import PartitionRange, Position, RangeStart
from rollout_bus.wire.headers import control_kind

logger = logging.getLogger(__name__)

STALL_S = 30.0
POLL_MS = 500
TOPIC_WAIT_S = 3.0  # a topic named on the command line: it exists or it is a typo
ENDS_BOUND_S = 30.0  # the longest a watcher waits for end offsets before it asks with a new client


def topic_names(conn: Mapping[str, Any]) -> set[str]:
    """The names of every topic on the cluster."""
    consumer = group_less_consumer(conn, client_id="rollout-bus-topics")
    try:
        return set(consumer.topics())
    finally:
        consumer.close()


def open_reader(conn: Mapping[str, Any]) -> KafkaConsumer:
    """A group-less consumer for offset ranges: it fails on an offset out of range instead of resetting."""
    return group_less_consumer(conn, client_id="rollout-bus-ops", auto_offset_reset="none")


class TopicWatcher:
    """Counts records per topic (end offsets) and reads chosen topics in full, incrementally."""

    def __init__(self, conn: Mapping[str, Any], count_topics: list[str], read_topics: list[str],
                 data_topics: list[str] | tuple[str, ...] = ()):
        self.conn = dict(conn)
        self.ends_bound_s = ENDS_BOUND_S
        self.replaced = 0  # end-offset clients abandoned because an answer never came
        self._ender: KafkaConsumer | None = None
        self.consumer = group_less_consumer(conn, client_id="rollout-bus-watch")
        self.count_topics = count_topics
        self.data_topics = list(data_topics)
        try:
            self._partitions = {t: [TopicPartition(t, p) for p in wait_for_partitions(self.consumer, t)]
                                for t in set(count_topics) | set(read_topics) | set(self.data_topics)}
        except BaseException:  # a caller that retries (broker outage, topic not there yet) leaks no client
            self.consumer.close()
            raise
        self.read_topics = read_topics
        assigned = [tp for t in sorted(set(read_topics) | set(self.data_topics)) for tp in self._partitions[t]]
        self.consumer.assign(assigned)
        self.consumer.seek_to_beginning(*assigned)
        self.records: dict[str, list] = {t: [] for t in read_topics}
        self.data_records: dict[str, int] = {t: 0 for t in data_topics}
        self.control_records: dict[str, int] = {t: 0 for t in data_topics}
        self._last_counts = {t: 0 for t in count_topics}

    def counts(self) -> dict[str, int]:
        """Records ever written to each counted topic (the last known counts while a leader is being
        elected); for a data topic, the data records read so far."""
        try:
            ends = self._end_offsets([tp for t in self.count_topics for tp in self._partitions[t]])
        except (KeyError, KafkaError):  # kafka-python raises KeyError for a partition with no leader yet
            ends = None
        if ends is not None:
            self._last_counts = {t: sum(ends.get(tp, 0) for tp in self._partitions[t]) for t in self.count_topics}
        counts = dict(self._last_counts)
        counts.update({t: n for t, n in self.data_records.items() if t in counts})
        return counts

    def read_new(self, timeout_ms: int = 200) -> int:
        """Take in newly arrived records of the read and data topics; return how many arrived."""
        got = 0
        for tp, batch in self.consumer.poll(timeout_ms=timeout_ms, max_records=5000).items():
            if tp.topic in self.data_records:
                control = sum(1 for r in batch if control_kind(r.headers) is not None)
                self.control_records[tp.topic] += control
                self.data_records[tp.topic] += len(batch) - control
            if tp.topic in self.records:
                self.records[tp.topic].extend(batch)
            got += len(batch)
        return got

    def catch_up(self, timeout_s: float = 30.0) -> bool:
        """Read until every read and data topic reached its end offsets as of now; False on timeout."""
        assigned = [tp for t in sorted(set(self.read_topics) | set(self.data_topics)) for tp in self._partitions[t]]
        deadline = time.monotonic() + timeout_s
        try:
            ends = self._end_offsets(assigned)
        except (KeyError, KafkaError):
            return False
        if ends is None:
            return False
        while time.monotonic() < deadline:
            if all(self.consumer.position(tp) >= end for tp, end in ends.items()):
                return True
            self.read_new(timeout_ms=200)
        return False

    def _end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int] | None:
        """The end offsets, asked by the watcher's own end-offset client and waited for at most
        ``ends_bound_s``; None (the client replaced, a WARNING said) when no answer came by then."""
        if self._ender is None:
            self._ender = group_less_consumer(self.conn, client_id="rollout-bus-watch-ends")
        ender, box = self._ender, {}

        def ask() -> None:
            try:
                box["ends"] = ender.end_offsets(partitions)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
        asking = threading.Thread(target=ask, name="rollout-bus-watch-ends", daemon=True)
        asking.start()
        asking.join(self.ends_bound_s)
        if asking.is_alive():
            logger.warning("end offsets of %d partitions not answered in %.0fs (kafka-python's request never "
                           "returned): asking with a new client from now on", len(partitions), self.ends_bound_s)
            self._ender, self.replaced = None, self.replaced + 1
            threading.Thread(target=ender.close, name="rollout-bus-watch-ends-close", daemon=True).start()
            return None
        if "error" in box:
            raise box["error"]
        return box["ends"]

    def dead_letters(self, topic: str) -> list[DeadLetter]:
        return [DeadLetter.from_record(r.key, r.value, r.headers) for r in self.records.get(topic, [])]

    def json_values(self, topic: str) -> list[dict]:
        values = []
        for record in self.records.get(topic, []):
            try:
                values.append(json.loads(record.value))
            except (TypeError, ValueError):
                continue  # counted by whoever owns the topic; not ours to judge here
        return values

    def close(self) -> None:
        self.consumer.close()
        if self._ender is not None:
            self._ender.close()
            self._ender = None


class TopicReader:
    """New records of a few topics, oldest first per partition."""

    def __init__(self, conn: Mapping[str, Any], names: list[str], *, history: int | None = None) -> None:
        self.names = list(names)
        self._watcher = TopicWatcher(conn, count_topics=self.names, read_topics=self.names)
        if history is not None:
            self._seek_back(history)

    @property
    def consumer(self) -> KafkaConsumer:
        """The reader's own consumer (group-less), also good for end offsets of other topics."""
        return self._watcher.consumer

    def _seek_back(self, history: int) -> None:
        assigned = sorted(self.consumer.assignment())
        begins = self.consumer.beginning_offsets(assigned)
        ends = self.consumer.end_offsets(assigned)
        for tp in assigned:
            self.consumer.seek(tp, max(begins[tp], ends[tp] - max(history, 0)))

    def poll(self, timeout_ms: int = 200) -> dict[str, list]:
        """Records that arrived since the last call, per topic."""
        self._watcher.read_new(timeout_ms=timeout_ms)
        taken = {name: self._watcher.records[name] for name in self.names}
        for name in self.names:
            self._watcher.records[name] = []
        return taken

    def read_to_end(self, timeout_s: float = 30.0, *, stall_s: float | None = None) -> dict[str, list]:
        """Every record up to the end offsets as of now; BrokerError if that takes over ``timeout_s``.

        With ``stall_s`` (for a caller that retries, see the module docstring) ``timeout_s`` is not
        used: ``Unavailable`` once no record arrived for ``stall_s`` before the end, and each offset
        request waits at most ``stall_s``."""
        offsets_ms = None if stall_s is None else int(stall_s * 1000)
        assigned = sorted(self.consumer.assignment())
        ends = self.consumer.end_offsets(assigned, timeout_ms=offsets_ms)
        got: dict[str, list] = {name: [] for name in self.names}
        deadline = time.monotonic() + (timeout_s if stall_s is None else stall_s)
        while not all(self._reached(tp, ends[tp], offsets_ms) for tp in assigned):
            if time.monotonic() > deadline:
                if stall_s is not None:
                    raise Unavailable(f"no record from {self.names} for {stall_s:.0f}s before their end offsets")
                raise BrokerError(f"could not read {self.names} to their end offsets within {timeout_s:.0f}s")
            polled = self.poll()
            for name, records in polled.items():
                got[name].extend(records)
            if stall_s is not None and any(polled.values()):
                deadline = time.monotonic() + stall_s
        return got

    def _reached(self, tp: TopicPartition, end: int, timeout_ms: int | None) -> bool:
        position = self.consumer.position(tp, timeout_ms=timeout_ms)
        return position is not None and position >= end  # None: not resolved within timeout_ms

    def records_on(self, name: str) -> int:
        """Records ever written to one of the reader's topics (the sum of its end offsets)."""
        return self._watcher.counts().get(name, 0)

    def record_counts(self, names: Iterable[str]) -> dict[str, int]:
        """Records ever written to each of ``names`` (any topics; a missing one counts 0; one with a
        partition that has no leader right now is left out)."""
        counts = {}
        for name in names:
            if not self.consumer.partitions_for_topic(name):
                counts[name] = 0
                continue
            ends = partition_offsets(self.consumer, name)
            if ends is not None:
                counts[name] = sum(ends.values())
        return counts

    def close(self) -> None:
        self._watcher.close()


def read_topic(conn: Mapping[str, Any], topic: str, *, stall_s: float) -> list:
    """Every record of ``topic`` up to its end offsets, with a fresh group-less reader closed after; for a
    caller that retries through outages (``Unavailable`` after ``stall_s`` without progress, see above)."""
    reader = TopicReader(conn, [topic])
    try:
        return reader.read_to_end(stall_s=stall_s)[topic]
    finally:
        reader.close()


def partition_offsets(consumer: KafkaConsumer, topic: str, *, beginning: bool = False) -> dict[int, int] | None:
    """End (or ``beginning``) offset of each partition of ``topic``; None while the topic is not in the
    metadata or a partition has no leader."""
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    if not tps:
        return None
    try:
        found = consumer.beginning_offsets(tps) if beginning else consumer.end_offsets(tps)
    except (KeyError, KafkaError) as exc:  # a partition without a leader right now
        logger.debug("offsets unavailable topic=%s: %s", topic, exc)
        return None
    return {tp.partition: offset for tp, offset in found.items()}


def resolve_ranges(consumer: KafkaConsumer, starts: Sequence[RangeStart], to: int | None = None) -> list[PartitionRange]:
    """Concrete ``[start, stop)`` ranges for the ``--from`` values (see the module docstring)."""
    if to is not None and (isinstance(to, bool) or to < 0):
        raise ConfigError(must_be("--to", "an offset >= 0", to))
    wanted: dict[TopicPartition, int | None] = {}
    for start in starts:
        known = wait_for_partitions(consumer, start.topic, timeout_s=TOPIC_WAIT_S)
        if start.partition is not None and start.partition not in known:
            raise ConfigError(must_be("partition", f"one of {known} of topic {start.topic!r}", start.partition))
        for p in known if start.partition is None else [start.partition]:
            tp = TopicPartition(start.topic, p)
            if tp in wanted:
                raise ConfigError(f"--from names {start.topic}:{p} twice")
            wanted[tp] = start.offset
    begins, ends = consumer.beginning_offsets(list(wanted)), consumer.end_offsets(list(wanted))
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


def fetch_records(conn: Mapping[str, Any], topic: str, offsets: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], Any]:
    """The records at ``offsets`` of ``topic`` by (partition, offset) (see the module docstring)."""
    wanted = {p: set(os) for p, os in offsets.items() if os}
    if not wanted:
        return {}
    consumer = open_reader(conn)
    try:
        tps = [TopicPartition(topic, p) for p in wanted]
        begins = consumer.beginning_offsets(tps)
        ends = consumer.end_offsets(tps)
        spans = []
        for tp in tps:
            held = [o for o in wanted[tp.partition] if begins[tp] <= o < ends[tp]]
            if held:
                spans.append(PartitionRange(topic, tp.partition, min(held), max(held) + 1))
        return {(record.partition, record.offset): record for record in read_ranges(consumer, spans)
                if record.offset in wanted[record.partition]}
    finally:
        consumer.close()


def fetch_record(conn: Mapping[str, Any], position: Position) -> Any:
    """The record at ``position``; ConfigError when the offset is out of range or holds none."""
    consumer = open_reader(conn)
    try:
        known = wait_for_partitions(consumer, position.topic, timeout_s=TOPIC_WAIT_S)
        if position.partition not in known:
            raise ConfigError(must_be("partition", f"one of {known} of topic {position.topic!r}", position.partition,
                                      where=str(position)))
        tp = TopicPartition(position.topic, position.partition)
        begins, ends = consumer.beginning_offsets([tp]), consumer.end_offsets([tp])
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
