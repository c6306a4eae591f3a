"""A turn that reaches its key's partition before its predecessor (the predecessor was produced to another
partition and is re-routed) waits for it and the episode is merged whole: nothing dead-lettered as a gap.
Before, the overtaking turn went to the DLQ as ``gap`` and its episode was abandoned."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaProducer

from rollout_bus.wire.codec import encode_samples
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.partitioning import partition_for
from rollout_bus.wire.episode_record import TURN_FIELDS, decode_episode
from rollout_bus.wire.rollout_key import rollout_key_of
from tests.integration.test_stream_worker import Reader, Worker, _generated

pytestmark = pytest.mark.kafka


def test_a_turn_ahead_of_its_re_routed_predecessor_waits_and_the_episode_merges_whole(
        kafka_bootstrap, topics, tmp_path):
    turns = [(s, a) for s, a in _generated(6, seed=41) if a["attempt"] == 0]
    by_key: dict[bytes, list] = {}
    for sample, args in turns:
        by_key.setdefault(rollout_key_of(sample).encode(), []).append((sample, args))
    key, episode = next((k, e) for k, e in by_key.items() if len(e) >= 3 and e[-1][1]["final"])
    home = partition_for(key, topics.turns_partitions)
    away = (home + 1) % topics.turns_partitions
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        def send(index: int, partition: int) -> None:
            sample, args = episode[index]
            headers = TurnHeaders(args["turn"], 0, args["final"], args["group_size"], int(time.time() * 1000))
            producer.send(topics.turns, key=key, value=encode_samples([sample], TURN_FIELDS),
                          headers=headers.to_kafka(), partition=partition).get(30)
        send(0, home)
        send(2, home)  # turn 2 overtakes turn 1, which a foreign client put on another partition
        send(1, away)
        for index in range(3, len(episode)):
            send(index, home)
    finally:
        producer.close()
    worker = Worker(kafka_bootstrap, topics, f"order-{uuid.uuid4().hex[:8]}", tmp_path)
    episodes = Reader(kafka_bootstrap, topics.episodes)
    try:
        got = [r for r in episodes.until(lambda rs: any(r.key == key for r in rs)) if r.key == key]
    finally:
        episodes.close()
        assert worker.stop() == 0
    assert [control_kind(r.headers) for r in got] == [None], worker.log()[-3000:]
    assert decode_episode(got[0].value)[1].turns == len(episode)
    counts = worker.counts()
    assert counts.get("turns_held", 0) >= 1 and counts.get("turns_released") == counts.get("turns_held")
    assert not any(k.startswith("dlq.") for k in counts), counts
