"""rollout.turns raised mid-run (4 -> 6 partitions): the stream worker says so and exits 75 to be restarted
(its state table is sized at start), the restarted worker raises its state changelog to match and merges the
episodes on the new partitions too. Before, the worker read the count once and never consumed partitions 4..7."""

from __future__ import annotations

import uuid

import pytest
from kafka.admin import KafkaAdminClient

from rollout_bus.config import GenerateSettings
from rollout_bus.publish.publisher import TurnPublisher
from rollout_bus.sim.generator import iter_turns
from rollout_bus.stream.app import EXIT_PARTITIONS_CHANGED, changelog_topic
from rollout_bus.wire.headers import control_kind
from tests.integration.test_stream_worker import Reader, Worker, _expected_episodes, _keys

pytestmark = pytest.mark.kafka


def _publish(kafka_bootstrap, topics, seed: int, first_id: int) -> list:
    turns = list(iter_turns(GenerateSettings(episodes=12, seed=seed, vocab_size=4096, max_response_len=32)))
    for sample, _ in turns:  # rollout ids of their own: new episodes
        sample.rollout_id += first_id
        sample.index += first_id
        sample.group_index += first_id
    with TurnPublisher(kafka_bootstrap, topic=topics.turns) as publisher:
        for sample, args in turns:
            publisher.publish_turn(sample, **args)
    return turns


def test_a_worker_exits_when_rollout_turns_gains_partitions_and_its_restart_reads_them_all(
        kafka_bootstrap, topics, tmp_path):
    app_id = f"grow-{uuid.uuid4().hex[:8]}"
    before = _publish(kafka_bootstrap, topics, 31, 0)
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path, name="first")
    episodes = Reader(kafka_bootstrap, topics.episodes)
    try:
        data = lambda rs: [r for r in rs if control_kind(r.headers) is None]  # noqa: E731
        assert _keys(data(episodes.until(lambda rs: _keys(data(rs)) >= set(_expected_episodes(before))))) \
            >= set(_expected_episodes(before)), worker.log()
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.create_partitions({topics.turns: 6})
        finally:
            admin.close()
        assert worker.proc.wait(timeout=90) == EXIT_PARTITIONS_CHANGED, worker.log()[-3000:]
        after = _publish(kafka_bootstrap, topics, 32, 1000)
        assert {p for p in range(4, 6)} & {r.partition for r in Reader(kafka_bootstrap, topics.turns).until(
            lambda rs: False, timeout_s=3)}  # some of the new turns are on the new partitions
        restarted = Worker(kafka_bootstrap, topics, app_id, tmp_path, name="second")
        try:
            want = set(_expected_episodes(before)) | set(_expected_episodes(after))
            assert _keys(data(episodes.until(lambda rs: _keys(data(rs)) >= want, timeout_s=120))) >= want, \
                restarted.log()[-3000:]
        finally:
            assert restarted.stop() == 0
    finally:
        episodes.close()
        worker.stop()
    line = next(line for line in worker.log().splitlines() if "now has 6 partitions" in line)
    assert f"topic={topics.turns} now has 6 partitions, this worker started with 4" in line, line
    assert f"topic={changelog_topic(topics.group(app_id))} had 4 partitions, raised to 6" in restarted.log()
