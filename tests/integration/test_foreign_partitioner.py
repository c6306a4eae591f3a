"""Turns from a client whose default partitioner is not Kafka's (librdkafka: CRC32-based) are re-routed to
their key's partition, so an episode whose turns come from two clients is merged whole by one of two stream
workers: nothing dead-lettered as a gap, nothing orphaned in the other worker's state."""

from __future__ import annotations

import zlib

import pytest

from rollout_bus.wire.codec import encode_samples
from rollout_bus.wire.partitioning import partition_for
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.rollout_key import rollout_key_of
from tests.integration.test_stream_worker import (Reader, Worker, _expected_episodes, _generated, _keys,
                                                  _wait_for_stable_group)


def _emitted(records) -> set:
    """(key, attempt) of the episode records (an abandoned episode's control record is not one)."""
    return _keys([r for r in records if control_kind(r.headers) is None])

confluent_kafka = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


class ForeignProducer:
    """librdkafka with its default partitioner (``consistent_random``), as a user's own client would be."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.producer, self.topic = confluent_kafka.Producer({"bootstrap.servers": bootstrap}), topic
        self.partitions: dict[bytes, int] = {}

    def send(self, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        def delivered(err, msg):
            assert err is None, err
            self.partitions[msg.key()] = msg.partition()

        self.producer.produce(self.topic, key=key, value=value, headers=headers, on_delivery=delivered)
        assert self.producer.flush(30) == 0  # acknowledged before the next turn is sent, as a generator's turns are


def test_an_episode_whose_turns_come_from_two_clients_is_merged_whole_by_two_workers(
        kafka_bootstrap, topics, tmp_path):
    from kafka import KafkaProducer

    app_id = "foreign-partitioner"
    one = Worker(kafka_bootstrap, topics, app_id, tmp_path, "one")
    two = Worker(kafka_bootstrap, topics, app_id, tmp_path, "two")
    _wait_for_stable_group(kafka_bootstrap, topics.group(app_id), members=2)
    turns = _generated(32, seed=21)
    expected = _expected_episodes(turns)
    python = KafkaProducer(bootstrap_servers=kafka_bootstrap)  # murmur2, like Java
    foreign = ForeignProducer(kafka_bootstrap, topics.turns)
    for sample, args in turns:
        key = rollout_key_of(sample).encode()
        value = encode_samples([sample], TURN_FIELDS)
        headers = TurnHeaders(args["turn"], args["attempt"], args["final"], args["group_size"], 1).to_kafka()
        # half the episodes: earlier turns from kafka-python, the final from librdkafka (the split);
        # the other half: every turn from librdkafka
        if args["final"] or zlib.crc32(key) % 2 == 0:
            foreign.send(key, value, headers)
        else:
            python.send(topics.turns, key=key, value=value, headers=headers).get(timeout=30)
    python.close()
    misplaced = {k for k, p in foreign.partitions.items() if p != partition_for(k, topics.turns_partitions)}
    assert misplaced, "librdkafka put every key where murmur2 does: the test would prove nothing"

    episodes = Reader(kafka_bootstrap, topics.episodes)
    try:
        got = _emitted(episodes.until(lambda rs: _emitted(rs) >= set(expected), timeout_s=90))
    finally:
        episodes.close()
        stopped = [one.stop(), two.stop()]
    logs = one.log()[-3000:] + two.log()[-3000:]
    assert got == set(expected) and stopped == [0, 0], (len(got), len(expected), logs)
    counts = [one.counts(), two.counts()]
    assert not any(k.startswith("dlq.") for c in counts for k in c), counts
    assert sum(c.get("turns_rerouted", 0) for c in counts) >= len(misplaced), counts
    assert sum(c.get("turns_stored", 0) for c in counts) == sum(1 for _, a in turns if not a["final"]), counts
