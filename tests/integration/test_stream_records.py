"""The stream stage on the real broker: long episodes, records over the size limit, end-of-run markers."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.partitioner.default import murmur2

from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.kafka.limits import consumer_config
from rollout_bus.wire.control_records import END_OF_RUN_KEY, Abandoned, EndOfRun
from rollout_bus.wire.episode_record import decode_episode
from rollout_bus.wire.headers import control_kind
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from tests.integration.test_stream_worker import Reader, Worker

pytestmark = pytest.mark.kafka


def _long_turns(group_index: int, turns: int, tokens_per_turn: int, support: int, seed: int = 0) -> list[Sample]:
    """One episode of ``turns`` turns, each adding ``tokens_per_turn`` response tokens with a
    ``support``-wide sampling support per token (the prompt is 8 tokens)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 32_000, 8)
    history, out = prompt, []
    for turn in range(turns):
        response = rng.integers(0, 32_000, tokens_per_turn)
        ids = rng.integers(0, 32_000, (tokens_per_turn, support)).astype(np.int32)
        ids[:, 0] = response
        offsets = np.arange(0, tokens_per_turn * support + 1, support, dtype=np.int64)
        tokens = np.concatenate([history, response])
        out.append(Sample(group_index=group_index, index=0, rollout_id=0, tokens=tokens, response_length=tokens_per_turn,
                          rollout_log_probs=rng.normal(-1, 0.5, tokens_per_turn), reward=1.0,
                          weight_versions=["0"], rollout_sampling_mask=RolloutSamplingMask(ids.ravel(), offsets),
                          status=Status.COMPLETED))
        history = np.concatenate([tokens, rng.integers(0, 32_000, 4)])  # the next turn's observation
    return out


def _publish(bootstrap, topics, episode: list[Sample], **kafka) -> None:
    with TurnPublisher(bootstrap, topic=topics.turns, **kafka) as publisher:
        for turn, sample in enumerate(episode):
            publisher.publish_turn(sample, turn=turn, final=turn == len(episode) - 1, group_size=1)


def _reader(bootstrap, topic) -> Reader:
    reader = Reader.__new__(Reader)
    reader.consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                    enable_auto_commit=False, group_id=None, **consumer_config())
    reader.records = []
    return reader


def test_an_episode_of_128k_response_tokens_with_masks_flows_through_on_default_settings(kafka_bootstrap, topics,
                                                                                          tmp_path):
    episode = _long_turns(0, turns=4, tokens_per_turn=32_768, support=8)
    worker = Worker(kafka_bootstrap, topics, f"long-{topics.prefix}", tmp_path)
    reader = _reader(kafka_bootstrap, topics.episodes)
    try:
        _publish(kafka_bootstrap, topics, episode)
        (record,) = reader.until(lambda rs: len(rs) >= 1, timeout_s=120)
        segments, info = decode_episode(record.value)
        assert len(record.value) > 4 << 20  # well over Kafka's default 1 MiB record limit
        # and over the consumers' fetch size per partition: a larger batch still comes whole (KIP-74)
        assert len(record.value) > consumer_config()["max_partition_fetch_bytes"]
        assert len(segments) == 1 and segments[0].response_length == 4 * 32_768 + 3 * 4
        assert info.turns == 4 and len(segments[0].rollout_sampling_mask) == segments[0].response_length
    finally:
        reader.close()
        assert worker.stop() == 0, worker.log()[-3000:]


def test_an_episode_over_the_record_limit_is_dead_lettered_by_reference_and_abandoned(kafka_bootstrap, topics,
                                                                                       tmp_path):
    # 1 MiB values (+ headroom): each 900 kB turn fits, the merged ~2.7 MB episode does not
    episode = _long_turns(1, turns=3, tokens_per_turn=20_000, support=8)
    os.environ["ROLLOUT_BUS_MAX_RECORD_BYTES"] = str(1 << 20)
    try:
        worker = Worker(kafka_bootstrap, topics, f"big-{topics.prefix}", tmp_path)
    finally:
        del os.environ["ROLLOUT_BUS_MAX_RECORD_BYTES"]
    episodes, dlq = _reader(kafka_bootstrap, topics.episodes), _reader(kafka_bootstrap, topics.dlq)
    try:
        _publish(kafka_bootstrap, topics, episode)
        (marker,) = episodes.until(lambda rs: len(rs) >= 1, timeout_s=90)
        assert control_kind(marker.headers) == "abandoned" and Abandoned.from_value(marker.value).kind == "too_large"
        (letter,) = [DeadLetter.from_record(r.key, r.value, r.headers) for r in dlq.until(lambda rs: len(rs) >= 1)]
        assert letter.kind == "too_large" and letter.value is None and letter.key == marker.key
        assert "offsets [0, 1, 2]" in letter.reason
    finally:
        episodes.close()
        dlq.close()
        assert worker.stop() == 0, worker.log()[-3000:]  # never fatal
    assert worker.counts().get("episodes_too_large") == 1


def test_end_of_run_reaches_every_episode_partition_after_the_episodes_of_its_turns_partition(kafka_bootstrap, topics,
                                                                                                tmp_path):
    worker = Worker(kafka_bootstrap, topics, f"eor-{topics.prefix}", tmp_path)
    reader = _reader(kafka_bootstrap, topics.episodes)
    try:
        episodes = [_long_turns(g, turns=2, tokens_per_turn=16, support=2, seed=g) for g in range(8)]
        for episode in episodes:
            _publish(kafka_bootstrap, topics, episode)
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        marker = EndOfRun("run-1")
        for partition in range(topics.turns_partitions):
            producer.send(topics.turns, key=END_OF_RUN_KEY, value=marker.value(), headers=marker.headers(),
                          partition=partition)
        producer.close()
        expected = 8 + topics.turns_partitions * topics.episodes_partitions
        records = reader.until(lambda rs: len(rs) >= expected, timeout_s=90)
        seen: dict[int, set[int]] = {}
        for record in records:  # on every episodes partition: no episode after the marker of its turns partition
            if control_kind(record.headers) == "end-of-run":
                forwarded = EndOfRun.from_value(record.value)
                assert forwarded.run == "run-1" and forwarded.turns_partitions == topics.turns_partitions
                seen.setdefault(record.partition, set()).add(forwarded.turns_partition)
            else:  # the episode's turns partition (Kafka's default murmur2 partitioner) has not ended here yet
                turns_partition = (murmur2(record.key) & 0x7FFFFFFF) % topics.turns_partitions
                assert turns_partition not in seen.get(record.partition, set())
        assert seen == {p: set(range(topics.turns_partitions)) for p in range(topics.episodes_partitions)}
        assert sum(control_kind(r.headers) is None for r in records) == 8
    finally:
        reader.close()
        assert worker.stop() == 0, worker.log()[-3000:]
