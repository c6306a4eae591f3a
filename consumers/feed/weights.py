"""The trainer's weight versions on rollout.weights: one publisher, any number of watchers.

The control loop of asynchronous RL closed over Kafka: the trainer says which weights are live,
generators read it to stamp their turns and to hold back work that would be too stale.

Contract:

* ``WeightPublisher(conn, topics)``: ``publish(version, step, uri=, sha256=, size=)`` sends a
  ``weight_version.WeightVersion`` (with the checkpoint's place, digest and size when the trainer ships its weights)
  (key ``WEIGHTS_KEY``, acks=all) and returns once the broker has it. A version below the last
  one this publisher sent is a ``ConfigError`` (versions only grow).
* ``WeightWatcher(conn, topics, initial=0)`` reads rollout.weights group-less from its beginning
  (compacted: the latest version survives), so a watcher started late still knows the version.
  ``refresh()`` takes in what arrived; ``latest`` is the newest ``WeightVersion`` read (None before
  any) and ``version`` its version, or ``initial`` (the policy generators start with) when none was
  published yet. A record that does not parse is logged and skipped.
* ``wait_for(min_version, timeout_s=None, on_wait=None, stop=None)`` returns the version once it is
  at least ``min_version``; ``on_wait(version, min_version, waited_s)`` is called about every
  ``log_every_s`` while it waits (say why on the progress line); ``stop()`` True ends the wait with
  ``Stopped``; past ``timeout_s`` (None: no limit) it raises ``FeedTimeoutError`` naming both versions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from rollout_bus.errors import ConfigError, ContractError, FeedTimeoutError, Stopped, must_be
from rollout_bus.kafka.clients import new_producer
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.kafka.refusals import refusals_named
from rollout_bus.wire.weight_version import WEIGHTS_KEY, WeightVersion
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

POLL_MS = 200
SEND_TIMEOUT_S = 60.0


class WeightPublisher:
    """The trainer's side: one record per new live version."""

    def __init__(self, conn: Mapping[str, Any], topics: Topics) -> None:
        self.topic = topics.weights
        self._conn = conn
        self._producer = new_producer(conn, acks="all", client_id="rollout-bus-weights")
        self._last: int | None = None

    def publish(self, version: int, step: int, *, uri: str | None = None, sha256: str | None = None,
                size: int | None = None) -> WeightVersion:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(must_be("weight version", "an int >= 0", version))
        if self._last is not None and version < self._last:
            raise ConfigError(must_be("weight version", f">= {self._last} (the last one published)", version))
        record = WeightVersion(version, int(step), time.time_ns() // 1_000_000, uri, sha256, size)
        with refusals_named(f"publishing weights version {version} to {self.topic}", self._conn):
            self._producer.send(self.topic, key=WEIGHTS_KEY, value=record.value()).get(timeout=SEND_TIMEOUT_S)
        self._last = version
        logger.info("published weights version=%d step=%d topic=%s", version, step, self.topic)
        return record

    def close(self) -> None:
        self._producer.close()


class WeightWatcher:
    """The generators' side: the trainer's live version, read from the compacted topic."""

    def __init__(self, conn: Mapping[str, Any], topics: Topics, *, initial: int = 0,
                 log_every_s: float = 10.0) -> None:
        self.topic, self.initial, self.log_every_s = topics.weights, int(initial), log_every_s
        self.latest: WeightVersion | None = None
        self._reader = TopicReader(conn, [self.topic])

    @property
    def version(self) -> int:
        return self.latest.version if self.latest is not None else self.initial

    def refresh(self, timeout_ms: int = 0) -> int:
        """Take in new records; return the current version."""
        for record in self._reader.poll(timeout_ms=timeout_ms)[self.topic]:
            if record.key != WEIGHTS_KEY:
                continue
            try:
                found = WeightVersion.from_value(record.value)
            except ContractError as exc:
                logger.warning("skipped a record of %s at offset %d: %s", self.topic, record.offset, exc)
                continue
            if self.latest is None or found.version >= self.latest.version:
                self.latest = found
        return self.version

    def wait_for(self, min_version: int, *, timeout_s: float | None = None,
                 on_wait: Callable[[int, int, float], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> int:
        """The version, once it is at least ``min_version`` (see the module docstring)."""
        began = last_said = time.monotonic()
        while self.refresh(timeout_ms=POLL_MS) < min_version:
            now = time.monotonic()
            if stop is not None and stop():
                raise Stopped(f"stopped while waiting for weights version {min_version} (live: {self.version})")
            if timeout_s is not None and now - began > timeout_s:
                raise FeedTimeoutError(f"weights version {min_version} was not published on {self.topic} within "
                                       f"{timeout_s:.0f}s (live: {self.version}); is the trainer running?")
            if on_wait is not None and now - last_said >= self.log_every_s:
                last_said = now
                on_wait(self.version, min_version, now - began)
        return self.version

    def close(self) -> None:
        self._reader.close()
