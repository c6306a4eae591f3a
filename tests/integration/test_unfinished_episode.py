"""A generator that dies mid-episode, and a run closed with end-of-run instead of a restart, on the real broker.

The turns of one episode are published without its final turn, and another episode of the same kind never
starts; then the run's end-of-run markers. The stream worker (a ``rollout-bus stream`` subprocess) dead-letters
the unfinished episode's turns as ``unfinished`` naming its key, turns and generator, abandons it and removes it
from its state before it forwards the markers; the shard writer completes that group with the abandoned record,
and writes the group that lacks a never-started episode flagged (``complete: false``), warned of and counted.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from kafka import KafkaConsumer, TopicPartition

from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.rollout_key import rollout_key_of
from rollout_bus.wire.run_record import RunBatching
from tests.integration.test_shard_writer import manifests
from tests.integration.test_shard_writer_control import WriterThread
from tests.integration.test_stream_worker import Reader, Worker, _generated

pytestmark = pytest.mark.kafka

GENERATOR = "gen-dead-1"


def _changelog(kafka_bootstrap: str, topic: str) -> dict[bytes, bytes | None]:
    """The state changelog as a compacted reader sees it: each key's last value (None: deleted)."""
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False, group_id=None)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        ends, last = consumer.end_offsets(partitions), {}
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            for records in consumer.poll(timeout_ms=500).values():
                last.update((r.key, r.value) for r in records)
        return last
    finally:
        consumer.close()


def test_a_dead_generators_episode_is_dead_lettered_abandoned_and_forgotten_and_a_short_group_is_counted(
        kafka_bootstrap, client_kwargs, topics, tmp_path, caplog):
    turns = _generated(12, seed=11)  # 3 groups of 4
    by_key: dict[bytes, list] = {}
    for sample, args in turns:
        by_key.setdefault(rollout_key_of(sample).encode(), []).append((sample, args))
    # one episode of several turns, one attempt, loses its final turn; the last group loses a whole episode
    dead = next(k for k, ts in by_key.items() if len(ts) >= 2 and {a["attempt"] for _, a in ts} == {0})
    never = next(k for k in reversed(by_key) if by_key[k][0][0].group_index != by_key[dead][0][0].group_index)
    sent = [(s, a) for s, a in turns if rollout_key_of(s).encode() != never
            and not (rollout_key_of(s).encode() == dead and a["final"])]
    publisher = TurnPublisher(kafka_bootstrap, topic=topics.turns, generator=GENERATOR)
    for sample, args in sent:
        publisher.publish_turn(sample, **args)
    publisher.publish_end_of_run("run-dead")
    publisher.close()

    app_id = f"stream-test-{uuid.uuid4().hex[:8]}"
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path)
    dlq = Reader(kafka_bootstrap, topics.dlq)
    caplog.set_level(logging.WARNING, logger="rollout_bus.consumers.shard_writer")
    try:
        writer = WriterThread(client_kwargs, topics, tmp_path / "shards", uuid.uuid4().hex,
                              run_batching=RunBatching(1))
        writer.join(timeout=120)
        stored = len(by_key[dead]) - 1
        letters = [DeadLetter.from_record(r.key, r.value, r.headers)
                   for r in dlq.until(lambda rs: len(rs) >= stored)]
    finally:
        dlq.close()
        assert worker.stop() == 0
    assert [(d.kind, d.stage, d.key) for d in letters] == [("unfinished", "stream", dead)] * stored, worker.log()
    assert dead.decode() in letters[0].reason and f"generator {GENERATOR!r}" in letters[0].reason
    assert f"turns 0..{stored - 1} of {stored}" in letters[0].reason
    assert "UNFINISHED episode" in worker.log() and worker.counts()["episodes_unfinished"] == 1

    state = _changelog(kafka_bootstrap, f"{topics.prefix}{app_id}-state-changelog")
    assert any(k.endswith(dead) for k in state)  # its turns were stored ...
    assert all(v is None for k, v in state.items() if k.endswith(dead))  # ... and nothing of it is left

    assert writer.error is None and writer.writer.stats.runs_ended == 1
    groups = {g["group_index"]: g for m in manifests(tmp_path / "shards") for g in m["extra"]["groups"]}
    abandoned = [a for m in manifests(tmp_path / "shards") for a in m["extra"]["abandoned"]]
    assert [(a["key"], a["kind"]) for a in abandoned] == [(dead.decode(), "unfinished")]
    dead_group, short_group = by_key[dead][0][0].group_index, by_key[never][0][0].group_index
    assert (groups[dead_group]["abandoned"], groups[dead_group]["complete"]) == (1, True)
    assert (groups[short_group]["episodes"], groups[short_group]["complete"]) == (3, False)
    assert writer.writer.stats.incomplete_groups == 1
    assert any("INCOMPLETE group" in r.getMessage() and f"group_index={short_group}" in r.getMessage()
               and "lacks 1 of its 4" in r.getMessage() for r in caplog.records)
