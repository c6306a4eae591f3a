"""rollout.weights against a real broker: the trainer publishes, any watcher (late ones too) sees the
latest version, and a wait for a version returns once the trainer gets there."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from rollout_bus.errors import ConfigError, FeedTimeoutError
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.consumers.feed.weights import WeightPublisher, WeightWatcher
from rollout_bus.wire.topics import Topics
from tests.integration.test_topic_admin import configs

pytestmark = pytest.mark.kafka


@pytest.fixture
def fresh(client_kwargs) -> Topics:
    topics = Topics(prefix=f"w{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, topics)
    return topics


def test_the_weights_topic_is_compacted_and_the_others_are_not(client_kwargs, fresh):
    found = configs(client_kwargs, [fresh.weights, fresh.turns], ["cleanup.policy"])
    assert found == {fresh.weights: {"cleanup.policy": "compact"}, fresh.turns: {"cleanup.policy": "delete"}}


def test_a_watcher_sees_the_initial_version_then_each_published_one_and_a_late_one_the_latest(client_kwargs, fresh):
    watcher = WeightWatcher(client_kwargs, fresh, initial=0)
    publisher = WeightPublisher(client_kwargs, fresh)
    try:
        assert watcher.refresh(timeout_ms=500) == 0 and watcher.latest is None
        publisher.publish(1, step=0)
        publisher.publish(2, step=1)
        assert watcher.wait_for(2, timeout_s=30) == 2 and watcher.latest.step == 1
        late = WeightWatcher(client_kwargs, fresh)
        try:
            assert late.wait_for(2, timeout_s=30) == 2
        finally:
            late.close()
        with pytest.raises(ConfigError, match="weight version"):
            publisher.publish(1, step=2)  # versions only grow
    finally:
        publisher.close()
        watcher.close()


def test_waiting_for_a_version_returns_when_the_trainer_publishes_it_and_says_why_meanwhile(client_kwargs, fresh):
    watcher = WeightWatcher(client_kwargs, fresh, log_every_s=0.2)
    publisher = WeightPublisher(client_kwargs, fresh)
    said: list[tuple[int, int]] = []
    timer = threading.Timer(1.5, lambda: publisher.publish(3, step=2))
    try:
        timer.start()
        began = time.monotonic()
        assert watcher.wait_for(3, timeout_s=60, on_wait=lambda v, need, s: said.append((v, need))) == 3
        assert time.monotonic() - began >= 1.0 and said and said[0] == (0, 3)
        with pytest.raises(FeedTimeoutError, match="weights version 9 was not published .* within 1s .live: 3"):
            watcher.wait_for(9, timeout_s=1)
    finally:
        timer.cancel()
        publisher.close()
        watcher.close()
