"""Two generators that make the same episode keys (two seeds, no group split) on one run: the second one's turns
are dead-lettered as ``collision`` naming both generators, and every episode emitted is the first one's, whole
(before, turns of two different episodes were merged under one key without a word)."""

from __future__ import annotations

import uuid

import pytest

from rollout_bus.config import GenerateSettings
from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.sim.generator import iter_turns
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.episode_record import decode_episode
from tests.integration.test_stream_worker import Reader, Worker, _expected_episodes

pytestmark = pytest.mark.kafka


def _publish_as(kafka_bootstrap, topics, settings: GenerateSettings) -> list:
    turns = list(iter_turns(settings))
    with TurnPublisher(kafka_bootstrap, topic=topics.turns, generator=settings.generator_id()) as publisher:
        for sample, args in turns:
            publisher.publish_turn(sample, **args)
    return turns


def test_a_second_generator_making_the_same_keys_is_refused_as_a_collision_not_merged(
        kafka_bootstrap, topics, tmp_path):
    knobs = dict(episodes=8, vocab_size=4096, max_response_len=32)
    first = _publish_as(kafka_bootstrap, topics, GenerateSettings(seed=21, **knobs))
    second = _publish_as(kafka_bootstrap, topics, GenerateSettings(seed=22, **knobs))
    expected = _expected_episodes(first)
    assert {key for key, _ in expected} == {key for key, _ in _expected_episodes(second)}  # the same keys
    worker = Worker(kafka_bootstrap, topics, f"collide-{uuid.uuid4().hex[:8]}", tmp_path)
    episodes, dlq = Reader(kafka_bootstrap, topics.episodes), Reader(kafka_bootstrap, topics.dlq)
    try:
        got = episodes.until(lambda rs: len(rs) >= len(expected))
        letters = [DeadLetter.from_record(r.key, r.value, r.headers)
                   for r in dlq.until(lambda rs: len(rs) >= len(second))]
    finally:
        episodes.close()
        dlq.close()
        assert worker.stop() == 0
    data = [r for r in got if control_kind(r.headers) is None]
    assert len(data) == len(expected) and not [r for r in got if control_kind(r.headers) is not None]
    for record in data:  # each episode is the first generator's, merged from its own turns only
        segments, info = decode_episode(record.value)
        assert [list(s.tokens) for s in segments] == [list(s.tokens) for s in expected[(record.key, info.attempt)]]
    assert len(letters) == len(second) and {d.kind for d in letters} == {"collision"}
    assert "from generator 'g0of1-seed22', but generator 'g0of1-seed21' already made this episode" in letters[0].reason
