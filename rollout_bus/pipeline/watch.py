"""Watching the topics from outside: record counts for progress, dead letters and manifests for accounting.

Contract: ``TopicWatcher(client_kwargs, count_topics, read_topics, data_topics=())`` joins no group
and commits nothing. ``counts()`` gives, per counted topic, the records ever written (end offsets),
except for ``data_topics``: those are read in full and only their data records are counted, never
control records (a ``control`` header: end-of-run markers, abandoned episodes), so an "episodes"
count is a count of episodes. Reading costs a fetch of every value (kafka-python cannot fetch
headers alone): fine for demos and tests, not for a production monitor. ``read_topics`` are read
and kept (``dead_letters``, ``json_values``). ``catch_up()`` reads until every read topic has
reached the end offsets it had when called.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from rollout_bus.dead_letter import DeadLetter
from rollout_bus.errors import BrokerError
from rollout_bus.records import control_kind


class TopicWatcher:
    """Counts records per topic (end offsets) and reads chosen topics in full, incrementally."""

    def __init__(self, client_kwargs: dict[str, Any], count_topics: list[str], read_topics: list[str],
                 data_topics: list[str] | tuple[str, ...] = ()):
        self.consumer = KafkaConsumer(**client_kwargs, enable_auto_commit=False, group_id=None,
                                      client_id="rollout-bus-watch")
        self.count_topics = count_topics
        self.data_topics = list(data_topics)
        self._partitions = {t: [TopicPartition(t, p) for p in self._partitions_of(t)]
                            for t in set(count_topics) | set(read_topics) | set(self.data_topics)}
        self.read_topics = read_topics
        assigned = [tp for t in sorted(set(read_topics) | set(self.data_topics)) for tp in self._partitions[t]]
        self.consumer.assign(assigned)
        self.consumer.seek_to_beginning(*assigned)
        self.records: dict[str, list] = {t: [] for t in read_topics}
        self.data_records: dict[str, int] = {t: 0 for t in data_topics}
        self.control_records: dict[str, int] = {t: 0 for t in data_topics}
        self._last_counts = {t: 0 for t in count_topics}

    def _partitions_of(self, topic: str, timeout_s: float = 30.0) -> list[int]:
        """A just-created topic may take a moment to appear in the metadata: wait for it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.consumer.partitions_for_topic(topic)
            if found:
                return sorted(found)
            self.consumer.topics()  # refreshes the cluster metadata
            time.sleep(0.2)
        raise BrokerError(f"topic {topic!r} does not exist (no partitions in the metadata after {timeout_s:.0f}s)")

    def counts(self) -> dict[str, int]:
        """Records ever written to each counted topic (the last known counts while a leader is being
        elected); for a data topic, the data records read so far."""
        try:
            ends = self.consumer.end_offsets([tp for t in self.count_topics for tp in self._partitions[t]])
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
            ends = self.consumer.end_offsets(assigned)
        except (KeyError, KafkaError):
            return False
        while time.monotonic() < deadline:
            if all(self.consumer.position(tp) >= end for tp, end in ends.items()):
                return True
            self.read_new(timeout_ms=200)
        return False

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
