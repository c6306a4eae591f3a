"""Reading one run's topics for its report: metrics, shard announcements and dead letters from the
beginning to their current end, and every topic's record count, through a group-less reader (it
commits nothing, so it can run beside the stages or long after).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.errors import BrokerError
from rollout_bus.kafka.reader import TopicReader, topic_names
from rollout_bus.observe.report import RawRun
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.topics import METRICS_TOPIC, Topics

logger = logging.getLogger(__name__)


def present_topics(conn: Mapping[str, Any], topics: Topics) -> list[str]:
    """The run's topics that exist; BrokerError naming the runs there are when none does."""
    found = topic_names(conn)
    present = [name for name in topics.names() if name in found]
    if not present:
        suffix = METRICS_TOPIC
        runs = sorted(t[: -len(suffix)] or "(no prefix)" for t in found if t.endswith(suffix))
        latest = [r for r in runs if r.startswith("demo-")][-6:] or runs[-6:]  # demo prefixes sort by time
        raise BrokerError(f"no topic {topics.metrics!r} (nor any other of this run) on the cluster; "
                          f"{len(runs)} runs there, e.g. --topic-prefix {' | '.join(latest) or '(none)'}")
    return present


def read_run(conn: Mapping[str, Any], topics: Topics, *, timeout_s: float = 60.0) -> RawRun:
    """Everything on the run's metrics, shards and DLQ topics now, and every topic's record count."""
    present = present_topics(conn, topics)
    names = [t for t in (topics.metrics, topics.shards, topics.dlq) if t in present]
    reader = TopicReader(conn, names)
    try:
        records = reader.read_to_end(timeout_s)
        counts = reader.record_counts(present)
    finally:
        reader.close()
    stamps = [r.timestamp for batch in records.values() for r in batch if r.timestamp and r.timestamp > 0]
    run = RawRun(counts=counts, first_ms=min(stamps, default=None), last_ms=max(stamps, default=None))
    run.metrics = _json_values(records.get(topics.metrics, []))
    # batch announcements only: the control records there (skipped batches, end of run) are not batches
    run.announcements = _json_values([r for r in records.get(topics.shards, []) if control_kind(r.headers) is None])
    run.dead_letters = [DeadLetter.from_record(r.key, r.value, r.headers) for r in records.get(topics.dlq, [])]
    return run


def _json_values(records: list) -> list[dict]:
    values = []
    for record in records:
        try:
            doc = json.loads(record.value)
        except (TypeError, ValueError):
            logger.warning("skipped a record that is not JSON topic=%s offset=%s", record.topic, record.offset)
            continue
        if isinstance(doc, dict):
            values.append(doc)
    return values
