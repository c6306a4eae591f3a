"""A stage's flow so far, on rollout.metrics: what a generator or a trainer alone can measure of its own time.

Why: how long a generator sat behind the staleness gate and how long the trainer waited for its next batch
are seen only inside those processes; on the bus, the exporter, ``tail`` and the report read them as they
read the window and batch metrics.

Contract: ``FlowReporter(conn, topics, stage, source, every_s=5.0)`` sends
``flow_metrics.flow_metrics_record(stage, source, metrics, elapsed_s=..., final=...)`` (WIRE.md 6.3, key
``flow_metrics.flow_key``) when ``report(metrics)`` is called at least ``every_s`` after the last send (the first
call sends), and always for ``report(metrics, final=True)``, which also waits until the broker has every
record. ``elapsed_s`` is the time since the reporter was made. The producer is made at the first send.
Reporting never stops the stage: a send the cluster refuses (``AccessDenied``: an ACL the principal lacks) is
one ERROR line, after which this reporter sends nothing more; any other failure (the cluster away) is a
WARNING and the next due report tries again (``failed`` counts them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from rollout_bus.errors import AccessDenied, BrokerError
from rollout_bus.kafka.clients import KafkaError, KafkaProducer, new_producer
from rollout_bus.kafka.refusals import refusals_named
from rollout_bus.wire.flow_metrics import flow_key, flow_metrics_record
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

FLOW_EVERY_S = 5.0
SEND_TIMEOUT_S = 30.0


class FlowReporter:
    """One stage's flow records (see the module docstring)."""

    def __init__(self, conn: Mapping[str, Any], topics: Topics, stage: str, source: str, *,
                 every_s: float = FLOW_EVERY_S) -> None:
        self.conn, self.topic, self.stage, self.source = dict(conn), topics.metrics, stage, source
        self.every_s = every_s
        self.key = flow_key(stage, source)
        self.began = time.monotonic()
        self.sent = 0
        self.failed = 0
        self._last_sent: float | None = None
        self._producer: KafkaProducer | None = None
        self._broken = False

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.began

    def report(self, metrics: dict[str, float], *, final: bool = False) -> bool:
        """Send ``metrics`` when due (see the module docstring); True when a record was sent."""
        now = time.monotonic()
        if self._broken or (not final and self._last_sent is not None and now - self._last_sent < self.every_s):
            return False
        value = flow_metrics_record(self.stage, self.source, metrics, elapsed_s=now - self.began, final=final)
        try:
            with refusals_named(f"reporting {self.stage} flow to {self.topic}", self.conn):
                if self._producer is None:
                    self._producer = new_producer(self.conn, acks="all", client_id=f"rollout-bus-flow-{self.stage}")
                future = self._producer.send(self.topic, key=self.key, value=value)
                if final:
                    future.get(timeout=SEND_TIMEOUT_S)
        except AccessDenied as exc:  # an ACL this principal lacks: asking again changes nothing
            self._broken = True
            logger.error("%s flow metrics are not reported from here on (the %s goes on): %s", self.stage,
                         self.stage, exc)
            return False
        except (BrokerError, KafkaError) as exc:  # the cluster away: said, and tried again when next due
            self._last_sent = now
            self.failed += 1
            logger.warning("%s flow metrics not reported this time (tried again in %.0fs; the %s goes on): %s",
                           self.stage, self.every_s, self.stage, exc)
            return False
        self._last_sent = now
        self.sent += 1
        return True

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
