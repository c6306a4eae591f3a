"""rollout.turns raised mid-run (4 -> 6 partitions): the stream worker says so and exits 75 to be restarted
(its state table is sized at start), the restarted worker raises its state changelog to match and merges the
episodes on the new partitions too. Before, the worker read the count once and never consumed partitions 4..7."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
from kafka.admin import KafkaAdminClient

from rollout_bus.config import GenerateSettings
from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.sim.generator import iter_turns
from rollout_bus.errors import EXIT_PARTITIONS_CHANGED
from rollout_bus.streams.app import changelog_topic
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


def test_a_shard_writer_exits_when_rollout_episodes_gains_partitions_and_its_restart_reads_them_all(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
    from tests.integration.test_shard_writer import GROUP_SIZE, REPO, make_episode, manifests, publish, writer_command

    publish(client_kwargs, topics.episodes, [make_episode(g, r) for g in range(2) for r in range(GROUP_SIZE)])
    out, log_path = tmp_path / "shards", tmp_path / "writer.log"
    group = f"grow-writer-{uuid.uuid4().hex[:6]}"
    command = [c for c in writer_command(kafka_bootstrap, topics, out, group) if c != "--exit-on-end-of-run"]
    with log_path.open("w") as log:
        writer = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while "reading topic=" not in log_path.read_text():
            assert writer.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.create_partitions({topics.episodes: 6})
        finally:
            admin.close()
        assert writer.wait(timeout=90) == EXIT_PARTITIONS_CHANGED, log_path.read_text()[-3000:]
    finally:
        if writer.poll() is None:
            writer.kill()
    assert f"topic={topics.episodes} now has 6 partitions, this writer reads 4" in log_path.read_text()
    later = [make_episode(g, r) for g in range(2, 4) for r in range(GROUP_SIZE)]
    publish(client_kwargs, topics.episodes, [(k, v, h, 4 + i % 2) for i, (k, v, h) in enumerate(later)])
    marker = EndOfRun("run-1")
    publish(client_kwargs, topics.episodes, [(END_OF_RUN_KEY, marker.forwarded(t, 2).value(), marker.headers(), p)
                                             for t in range(2) for p in range(6)])
    done = subprocess.run(writer_command(kafka_bootstrap, topics, out, group), cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum(len(m["extra"]["episodes"]) for m in manifests(out)) == 4 * GROUP_SIZE  # the new partitions too


def test_a_generator_says_when_the_partition_count_it_hashes_over_changes(kafka_bootstrap, topics, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="rollout_bus.producers.publisher")
    turns = list(iter_turns(GenerateSettings(episodes=2, seed=3, vocab_size=4096, max_response_len=32)))
    publisher = TurnPublisher(kafka_bootstrap, topic=topics.turns, metadata_max_age_ms=500)  # refreshes fast here
    try:
        publisher.publish_turn(turns[0][0], **turns[0][1])
        publisher.flush()
        assert publisher.partitions == 4
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.create_partitions({topics.turns: 6})
        finally:
            admin.close()
        deadline = time.monotonic() + 30
        while publisher.partitions == 4 and time.monotonic() < deadline:
            publisher._partitions_checked = float("-inf")  # the next send looks again (every 10 s otherwise)
            publisher.publish_turn(turns[0][0], **turns[0][1])
            publisher.flush()
            time.sleep(0.5)
    finally:
        publisher.close()
    assert publisher.partitions == 6
    said = [r.getMessage() for r in caplog.records if "partitions, 4 when this generator started" in r.getMessage()]
    assert said == [f"topic={topics.turns} now has 6 partitions, 4 when this generator started: new turns hash over 6 "
                    "(a turn of an episode in progress may land on another partition than its earlier turns; the "
                    "stream workers re-route it)"]
