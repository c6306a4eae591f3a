"""Watching the topics from outside: record counts for progress, dead letters and manifests for accounting."""

from __future__ import annotations

import json
import time
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from rollout_bus.dead_letter import DeadLetter
from rollout_bus.errors import BrokerError


class TopicWatcher:
    """Counts records per topic (end offsets) and reads chosen topics in full, incrementally."""

    def __init__(self, client_kwargs: dict[str, Any], count_topics: list[str], read_topics: list[str]):
        self.consumer = KafkaConsumer(**client_kwargs, enable_auto_commit=False, group_id=None,
                                      client_id="rollout-bus-watch")
        self.count_topics = count_topics
        self._partitions = {t: [TopicPartition(t, p) for p in self._partitions_of(t)]
                            for t in set(count_topics) | set(read_topics)}
        self.read_topics = read_topics
        assigned = [tp for t in read_topics for tp in self._partitions[t]]
        self.consumer.assign(assigned)
        self.consumer.seek_to_beginning(*assigned)
        self.records: dict[str, list] = {t: [] for t in read_topics}
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
        """Records ever written to each counted topic (the last known counts while a leader is being elected)."""
        try:
            ends = self.consumer.end_offsets([tp for t in self.count_topics for tp in self._partitions[t]])
        except (KeyError, KafkaError):  # kafka-python raises KeyError for a partition with no leader yet
            return dict(self._last_counts)
        self._last_counts = {t: sum(ends.get(tp, 0) for tp in self._partitions[t]) for t in self.count_topics}
        return dict(self._last_counts)

    def read_new(self, timeout_ms: int = 200) -> int:
        """Append newly arrived records of the read topics; return how many arrived."""
        got = 0
        for tp, batch in self.consumer.poll(timeout_ms=timeout_ms, max_records=5000).items():
            self.records[tp.topic].extend(batch)
            got += len(batch)
        return got

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
