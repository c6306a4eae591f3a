"""Reading topics from outside the pipeline: assign + seek, no consumer group, nothing committed.

Contract: ``TopicReader(client_kwargs, names, history=None)`` reads every partition of ``names``
from the beginning, or, with ``history=N``, from the last N records of each partition.
``poll()`` hands over the records that arrived since the last call (and forgets them, so a
long-running reader holds no history); ``read_to_end()`` polls until it has reached the end
offsets seen when it was called. It reuses ``pipeline.watch.TopicWatcher`` (group_id=None,
auto-commit off), so its reading is the demo's.

``MetricsFeed`` is what ``tail`` and the exporter share: a reader of rollout.metrics and
rollout.dlq folded into a ``MetricsView``, plus the stages' consumer-group lag, as one snapshot.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaConsumer

from rollout_bus.dead_letter import DeadLetter
from rollout_bus.errors import BrokerError
from rollout_bus.ops.lag import LagProbe
from rollout_bus.ops.metrics_view import MetricsView
from rollout_bus.pipeline.watch import TopicWatcher
from rollout_bus.topics import Topics

logger = logging.getLogger(__name__)


class TopicReader:
    """New records of a few topics, oldest first per partition."""

    def __init__(self, client_kwargs: dict[str, Any], names: list[str], *, history: int | None = None) -> None:
        self.names = list(names)
        self._watcher = TopicWatcher(client_kwargs, count_topics=self.names, read_topics=self.names)
        if history is not None:
            self._seek_back(history)

    @property
    def consumer(self) -> KafkaConsumer:
        """The reader's own consumer (group-less), also good for end offsets of other topics."""
        return self._watcher.consumer

    def _seek_back(self, history: int) -> None:
        assigned = sorted(self.consumer.assignment())
        begins = self.consumer.beginning_offsets(assigned)
        ends = self.consumer.end_offsets(assigned)
        for tp in assigned:
            self.consumer.seek(tp, max(begins[tp], ends[tp] - max(history, 0)))

    def poll(self, timeout_ms: int = 200) -> dict[str, list]:
        """Records that arrived since the last call, per topic."""
        self._watcher.read_new(timeout_ms=timeout_ms)
        taken = {name: self._watcher.records[name] for name in self.names}
        for name in self.names:
            self._watcher.records[name] = []
        return taken

    def read_to_end(self, timeout_s: float = 30.0) -> dict[str, list]:
        """Every record up to the end offsets as of now; BrokerError if that takes over ``timeout_s``."""
        assigned = sorted(self.consumer.assignment())
        ends = self.consumer.end_offsets(assigned)
        got: dict[str, list] = {name: [] for name in self.names}
        deadline = time.monotonic() + timeout_s
        while not all(self.consumer.position(tp) >= ends[tp] for tp in assigned):
            if time.monotonic() > deadline:
                raise BrokerError(f"could not read {self.names} to their end offsets within {timeout_s:.0f}s")
            for name, records in self.poll().items():
                got[name].extend(records)
        return got

    def records_on(self, name: str) -> int:
        """Records ever written to a topic (the sum of its end offsets)."""
        return self._watcher.counts().get(name, 0)

    def close(self) -> None:
        self._watcher.close()


class MetricsFeed:
    """rollout.metrics and rollout.dlq folded into a view, plus lag of the stages' groups."""

    def __init__(self, client_kwargs: dict[str, Any], topics: Topics, groups: list[tuple[str, str]], *,
                 adapter: str | None = None, history: int | None = None) -> None:
        self.topics, self.groups = topics, list(groups)
        self.view = MetricsView(adapter)
        self.reader = TopicReader(client_kwargs, [topics.metrics, topics.dlq], history=history)
        self.lag = LagProbe(client_kwargs, self.reader.consumer)

    def fold(self, records: dict[str, list]) -> int:
        """Add read records to the view; return how many."""
        for record in records.get(self.topics.metrics, []):
            self.view.add_metrics(record.value)
        for record in records.get(self.topics.dlq, []):
            self.view.add_dead_letter(DeadLetter.from_record(record.key, record.value, record.headers))
        return sum(len(batch) for batch in records.values())

    def catch_up(self, timeout_s: float = 60.0) -> int:
        """Read everything there is now (so counters start from the topics' totals)."""
        return self.fold(self.reader.read_to_end(timeout_s))

    def refresh(self, timeout_ms: int = 200) -> int:
        return self.fold(self.reader.poll(timeout_ms))

    def snapshot(self) -> dict[str, Any]:
        return self.view.snapshot(lag=[row.to_json() for row in self.lag.measure(self.groups)],
                                  dlq_records=self.reader.records_on(self.topics.dlq),
                                  topics={"metrics": self.topics.metrics, "dlq": self.topics.dlq})

    def close(self) -> None:
        self.lag.close()
        self.reader.close()
