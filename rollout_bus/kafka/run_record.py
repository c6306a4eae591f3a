"""Declaring the run's batching on rollout.run: the first declaration wins, a different one is refused.

A stage reads rollout.run to its end; when the topic holds no declaration yet it writes its own
(acks=all) and reads again, so two stages racing to declare agree on whichever record the broker
put first. The first ``batching`` record is the run's (``wire.run_record``); the stage is refused
with a ``ConfigError`` naming every setting that differs, before it reads or writes anything else.
No clock decides anything: the log order does. ``declared_run_batching(conn, topics)`` only reads it (an
observer: None while nothing is declared).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.clients import new_producer
from rollout_bus.kafka.reader import read_topic
from rollout_bus.kafka.refusals import refusals_named
from rollout_bus.kafka.retry import retrying
from rollout_bus.wire.run_record import RUN_BATCHING_KEY, RunBatching
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)


def declared_by(role: str) -> str:
    """Who declares: the role, host and pid (``shard writer@host:1234``), for the refusal message."""
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


def _first_declaration(conn: Mapping[str, Any], topic: str, stall_s: float) -> tuple[RunBatching, str] | None:
    records = sorted(read_topic(conn, topic, stall_s=stall_s), key=lambda r: (r.partition, r.offset))
    for record in records:
        if record.key == RUN_BATCHING_KEY:
            try:
                return RunBatching.parse(record.value), f"{topic}:{record.partition}:{record.offset}"
            except ContractError as exc:
                raise ConfigError(f"the run's batching at {topic}:{record.partition}:{record.offset} does not "
                                  f"parse ({exc}); use a fresh --topic-prefix") from exc
    return None


def _declare(conn: Mapping[str, Any], topics: Topics, ours: RunBatching, timeout_s: float) -> tuple[RunBatching, str]:
    ensure_topics(dict(conn), topics, only=[topics.run])
    found = _first_declaration(conn, topics.run, timeout_s)
    if found is None:
        producer = new_producer(conn, acks="all")
        try:
            with refusals_named(f"declaring the run's batching on {topics.run}", conn):
                producer.send(topics.run, key=RUN_BATCHING_KEY, value=ours.value(), partition=0).get(timeout=timeout_s)
        finally:
            producer.close()
        found = _first_declaration(conn, topics.run, timeout_s)
        if found is None:
            raise ConfigError(f"declared the run's batching on {topics.run} but cannot read it back")
    return found


def check_run_batching(conn: Mapping[str, Any], topics: Topics, ours: RunBatching, *,
                       timeout_s: float = 10.0) -> RunBatching:
    """The run's batching, declared now if nobody has; ConfigError when ``ours`` differs from it.

    Broker outages are waited out (``retry.retrying``), as every stage does at start: ``timeout_s`` bounds
    each step (a read that stalls, a send), after which the whole declaration is tried again."""
    run, where = retrying(lambda: _declare(conn, topics, ours, timeout_s),
                          f"declare the run's batching on {topics.run}")
    differs = run.differences(ours)
    if differs:
        raise ConfigError(f"this {ours.declared_by} has batching that differs from the run's, declared by "
                          f"{run.declared_by} at {where}: {'; '.join(differs)} (run's vs this one's). Start every "
                          "stage of a run with the same --groups-per-batch, --batching and --max-staleness, or "
                          "use a fresh --topic-prefix")
    logger.info("run batching topic=%s groups_per_batch=%d batching=%s max_staleness=%s declared_by=%s at=%s",
                topics.run, run.groups_per_batch, run.batching, run.max_staleness, run.declared_by, where)
    return run


def declared_run_batching(conn: Mapping[str, Any], topics: Topics, *, stall_s: float = 10.0) -> RunBatching | None:
    """The run's batching as declared on rollout.run, read only (an observer's view); None while none is."""
    found = _first_declaration(conn, topics.run, stall_s)
    return found[0] if found is not None else None
