"""The demo's watcher counts episodes, not records: control records on rollout.episodes are left out."""

from __future__ import annotations

import pytest
from kafka import KafkaProducer

from rollout_bus.kafka.reader import TopicWatcher
from rollout_bus.wire.control_records import END_OF_RUN_KEY, Abandoned, EndOfRun

pytestmark = pytest.mark.kafka


def test_control_records_are_not_counted_as_episodes_and_catch_up_reads_to_the_end(client_kwargs, topics):
    producer = KafkaProducer(**client_kwargs)
    for i in range(3):
        producer.send(topics.episodes, key=f"k{i}".encode(), value=b"episode", partition=i % 2)
    marker = EndOfRun("r").forwarded(0, 4)
    for partition in range(topics.episodes_partitions):
        producer.send(topics.episodes, key=END_OF_RUN_KEY, value=marker.value(), headers=marker.headers(),
                      partition=partition)
    gone = Abandoned(0, 4, "merge", "bad merge", f"{topics.turns}:0:7")
    producer.send(topics.episodes, key=b"k9", value=gone.value(), headers=gone.headers(), partition=1)
    producer.send(topics.dlq, key=b"k9", value=b"x")
    producer.flush()
    producer.close()

    watcher = TopicWatcher(client_kwargs, [topics.episodes, topics.dlq], [topics.dlq], data_topics=[topics.episodes])
    try:
        assert watcher.counts()[topics.episodes] == 0  # nothing read yet: no record taken for an episode
        assert watcher.catch_up(timeout_s=30)
        counts = watcher.counts()
        assert counts[topics.episodes] == 3 and counts[topics.dlq] == 1
        assert watcher.control_records[topics.episodes] == topics.episodes_partitions + 1
        assert [letter.key for letter in watcher.dead_letters(topics.dlq)] == [b"k9"]
    finally:
        watcher.close()
