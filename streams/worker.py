"""Running the stream worker programmatically (what ``rollout-bus stream`` calls).

Contract: ``run_worker(...)`` waits for the cluster to answer (saying why it does not, every 10 s:
``kafka.admin.wait_for_cluster``), creates the pipeline topics if missing (Faust must not subscribe to
a topic that does not exist), reads rollout.turns' partition count (the table must match it),
raises its state changelog's partitions to match if rollout.turns was raised since (a worker that sees the
count change exits 75 to be restarted: ``rollout_bus.streams.app``), builds the app (Faust's working directory
defaults to a temporary one) and runs it
(``rollout_bus.streams.app.run_app``: no web server, no Faust CLI) until SIGTERM/SIGINT. It returns the exit status:
0 after a clean stop, non-zero when the worker crashed; an agent crash ends the process itself
(``rollout_bus.streams.app.EXIT_AGENT_CRASH``). The outcome counts are logged periodically by the app and
once more at shutdown.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
from typing import Any

from rollout_bus.kafka.admin import ensure_topics, grow_partitions, wait_for_cluster
from rollout_bus.kafka.clients import group_less_consumer, wait_for_partitions
from rollout_bus.kafka.client_logs import quiet_client_logs
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES, Topics
from rollout_bus.streams.app import build_app, changelog_topic, run_app

logger = logging.getLogger(__name__)


def topic_partitions(client_kwargs: dict[str, Any], topic: str) -> int:
    """The partition count of an existing topic (metadata can lag a fresh create: waits briefly)."""
    consumer = group_less_consumer(client_kwargs, client_id="rollout-bus-stream-setup")
    try:
        return len(wait_for_partitions(consumer, topic))
    finally:
        consumer.close()


def run_worker(*, app_id: str, client_kwargs: dict[str, Any], topics: Topics, window_seconds: float = 60.0,
               grace_seconds: float = 10.0, data_dir: str | None = None, stats_interval_s: float = 30.0,
               commit_interval_s: float = 1.0, replication_factor: int = 1,
               max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> int:
    """Run one stream worker until it is stopped; returns the process exit status."""
    if not data_dir:  # Faust's default is a directory under the current one
        data_dir = os.path.join(tempfile.gettempdir(), "rollout-bus-stream", app_id)
    os.makedirs(data_dir, exist_ok=True)
    quiet_client_logs()  # aiokafka logs ~80 lines a second while a broker is down
    wait_for_cluster(client_kwargs, None)  # a bootstrap that never answers is said within seconds, and why
    ensure_topics(client_kwargs, topics, replication_factor=replication_factor, max_record_bytes=max_record_bytes)
    partitions = topic_partitions(client_kwargs, topics.turns)
    grow_partitions(client_kwargs, changelog_topic(app_id), partitions)  # rollout.turns raised since the last start
    stream_app = build_app(app_id=app_id, client_kwargs=client_kwargs, topics=topics, turns_partitions=partitions,
                           window_seconds=window_seconds, grace_seconds=grace_seconds, data_dir=data_dir,
                           stats_interval_s=stats_interval_s, commit_interval_s=commit_interval_s,
                           replication_factor=replication_factor,
                           episodes_partitions=topic_partitions(client_kwargs, topics.episodes),
                           max_record_bytes=max_record_bytes)
    logger.info("stream worker starting app_id=%s topic=%s partitions=%d window_s=%s grace_s=%s", app_id,
                topics.turns, partitions, window_seconds, grace_seconds)
    status = 1
    # what startup built (imports, Faust's app) lives as long as the process: a full collection
    # scanning it paused the event loop 55-72 ms (measured); frozen, collections see new objects only
    gc.freeze()
    try:
        status = run_app(stream_app)
    finally:
        logger.info("stream worker stopped status=%s counts %s", status, stream_app.processor.outcomes.summary())
    return status
