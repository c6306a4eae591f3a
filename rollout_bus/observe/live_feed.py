"""The live feed ``tail`` and the exporter share: rollout.metrics and rollout.dlq folded into a
``MetricsView``, the trainer's live weight version from rollout.weights, plus the stages'
consumer-group lag, as one snapshot.

Contract: ``MetricsFeed(conn, topics, groups, adapter=None, history=None)`` reads through a
group-less ``TopicReader`` (``history=N``: only the last N records of each partition);
``catch_up()`` reads everything there is now, ``refresh()`` what arrived since, ``snapshot()``
is the view's JSON with the lag rows of ``groups`` (``(group, topic)`` pairs), the DLQ's total,
and ``trainer`` (``MetricsView.snapshot``): the newest ``weight_version.WeightVersion`` a
``kafka.weights.WeightWatcher`` read from rollout.weights (always from its beginning: the topic is
compacted, ``history`` does not apply). A run without rollout.weights (no trainer publishing, or
an older run) is normal: until the topic exists (looked for again at most every
``WEIGHTS_RECHECK_S`` on ``refresh``) or while it holds no version, ``trainer`` has None values
and ``tail`` shows ``-``. ``run`` is the run's batching as declared on rollout.run
(``groups_per_batch``, ``batching``, ``max_staleness``: the staleness bound alerts compare with), read
once it is there (looked for on the same schedule), None before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.kafka.clients import KafkaError
from rollout_bus.kafka.lag import LagProbe
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.kafka.run_record import declared_run_batching
from rollout_bus.consumers.feed.weights import WeightWatcher
from rollout_bus.errors import BrokerError, ContractError
from rollout_bus.observe.metrics_view import MetricsView
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

WEIGHTS_RECHECK_S = 10.0
WEIGHTS_QUIET_MS = 200  # catch_up: rollout.weights is read once a poll this long brings nothing new
WEIGHTS_CATCH_UP_S = 10.0  # at most (a topic holding only unreadable records never gives a version)


class MetricsFeed:
    """rollout.metrics and rollout.dlq folded into a view, the trainer's version, and lag of the stages' groups."""

    def __init__(self, conn: Mapping[str, Any], topics: Topics, groups: list[tuple[str, str]], *,
                 adapter: str | None = None, history: int | None = None) -> None:
        self.conn, self.topics, self.groups = dict(conn), topics, list(groups)
        self.view = MetricsView(adapter)
        self.reader = TopicReader(conn, [topics.metrics, topics.dlq], history=history)
        self.lag = LagProbe(conn, self.reader.consumer)
        self.weights: WeightWatcher | None = None
        self.run: RunBatching | None = None
        self._checked = float("-inf")
        self._look_for_late_topics()

    def _look_for_late_topics(self) -> None:
        """rollout.weights (its watcher) and rollout.run (the declared batching) may appear after the feed
        starts: looked for with one metadata request at most every WEIGHTS_RECHECK_S until both are there."""
        now = time.monotonic()
        if (self.weights is not None and self.run is not None) or now - self._checked < WEIGHTS_RECHECK_S:
            return
        self._checked = now
        try:
            names = self.reader.consumer.topics()
        except KafkaError as exc:
            logger.debug("no topic list yet: %s", exc)
            return
        if self.weights is None and self.topics.weights in names:
            try:
                self.weights = WeightWatcher(self.conn, self.topics)
            except (KafkaError, BrokerError) as exc:  # MissingTopicError is a BrokerError: absent after all
                logger.debug("no watcher of %s yet: %s", self.topics.weights, exc)
        if self.run is None and self.topics.run in names:
            try:
                self.run = declared_run_batching(self.conn, self.topics, stall_s=5.0)
            except (KafkaError, BrokerError, ContractError) as exc:  # not readable yet, or not a declaration
                logger.debug("no run batching from %s yet: %s", self.topics.run, exc)

    def fold(self, records: dict[str, list]) -> int:
        """Add read records to the view; return how many."""
        for record in records.get(self.topics.metrics, []):
            self.view.add_metrics(record.value)
        for record in records.get(self.topics.dlq, []):
            self.view.add_dead_letter(DeadLetter.from_record(record.key, record.value, record.headers))
        return sum(len(batch) for batch in records.values())

    def catch_up(self, timeout_s: float = 60.0) -> int:
        """Read everything there is now (so counters start from the topics' totals)."""
        read = self.fold(self.reader.read_to_end(timeout_s))
        self._look_for_late_topics()
        weights = self.weights
        if weights is not None and self.reader.record_counts([self.topics.weights]).get(self.topics.weights):
            deadline = time.monotonic() + min(timeout_s, WEIGHTS_CATCH_UP_S)
            seen = weights.latest
            while time.monotonic() < deadline:
                weights.refresh(timeout_ms=WEIGHTS_QUIET_MS)
                if weights.latest is not None and weights.latest is seen:
                    break
                seen = weights.latest
        return read

    def refresh(self, timeout_ms: int = 200) -> int:
        self._look_for_late_topics()
        if self.weights is not None:
            self.weights.refresh(timeout_ms=0)
        return self.fold(self.reader.poll(timeout_ms))

    def snapshot(self) -> dict[str, Any]:
        latest = self.weights.latest if self.weights is not None else None
        snapshot = self.view.snapshot(lag=[row.to_json() for row in self.lag.measure(self.groups)],
                                      dlq_records=self.reader.records_on(self.topics.dlq),
                                      topics={"metrics": self.topics.metrics, "dlq": self.topics.dlq,
                                              "weights": self.topics.weights},
                                      weights=latest)
        snapshot["run"] = None if self.run is None else {
            "groups_per_batch": self.run.groups_per_batch, "batching": self.run.batching,
            "max_staleness": self.run.max_staleness}
        return snapshot

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        self.lag.close()
        self.reader.close()
