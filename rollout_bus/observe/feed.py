"""The live feed ``tail`` and the exporter share: rollout.metrics and rollout.dlq folded into a
``MetricsView``, plus the stages' consumer-group lag, as one snapshot.

Contract: ``MetricsFeed(conn, topics, groups, adapter=None, history=None)`` reads through a
group-less ``TopicReader`` (``history=N``: only the last N records of each partition);
``catch_up()`` reads everything there is now, ``refresh()`` what arrived since, ``snapshot()``
is the view's JSON with the lag rows of ``groups`` (``(group, topic)`` pairs) and the DLQ's total.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_bus.dead_letter import DeadLetter
from rollout_bus.kafka.lag import LagProbe
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.observe.metrics_view import MetricsView
from rollout_bus.topics import Topics


class MetricsFeed:
    """rollout.metrics and rollout.dlq folded into a view, plus lag of the stages' groups."""

    def __init__(self, conn: Mapping[str, Any], topics: Topics, groups: list[tuple[str, str]], *,
                 adapter: str | None = None, history: int | None = None) -> None:
        self.topics, self.groups = topics, list(groups)
        self.view = MetricsView(adapter)
        self.reader = TopicReader(conn, [topics.metrics, topics.dlq], history=history)
        self.lag = LagProbe(conn, self.reader.consumer)

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
