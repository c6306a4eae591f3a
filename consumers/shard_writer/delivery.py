"""Confirmed sends: the shard writer commits past nothing whose records are not acknowledged.

Contract:

* ``Outbox(producer, should_stop=...)`` wraps a kafka-python ``KafkaProducer``. ``send(...)``
  hands a record to the producer (waiting through broker outages with
  ``rollout_bus.kafka.retry.retrying``) and keeps its future; ``confirm()`` returns once every
  record sent so far is acknowledged. The writer calls ``confirm()`` before every offset commit
  and between a batch's metrics record and its manifest.
* ``confirm()`` flushes in slices of ``flush_wait_s`` (one WARNING per slice while the broker is
  away), then checks every future: a send that failed with a transient error (a delivery
  timeout, a lost connection) is sent again; one the producer or broker refused for its size
  goes to the send's ``too_large`` callback, which returns a replacement record (the writer's
  dead letter by reference) or None (give up, the callback has logged why); a replacement refused
  for its size too is logged as an ERROR and dropped (never fatal). Any other failure, or a size
  refusal with no callback, raises ``BrokerError``.
* A re-sent record may be stored twice (the first copy can land after its future timed out):
  a manifest can then appear twice on rollout.shards, a batch-metrics record twice on
  rollout.metrics and a dead letter twice on rollout.dlq. Readers of rollout.shards dedupe by the
  record key (the batch seq); nothing is ever lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_bus.errors import BrokerError
from rollout_bus.kafka.retry import describe, is_too_large, is_transient, retrying

logger = logging.getLogger(__name__)

FLUSH_WAIT_S = 10.0
Headers = list[tuple[str, bytes]]


@dataclass(frozen=True)
class Outgoing:
    """One record to send, and what it is (for log lines)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    what: str


TooLarge = Callable[[Outgoing, BaseException], "Outgoing | None"]


@dataclass
class _Sent:
    record: Outgoing
    future: Any
    too_large: TooLarge | None


class Outbox:
    """Records handed to the producer and not yet confirmed (see the module docstring)."""

    def __init__(self, producer: Any, *, should_stop: Callable[[], bool] = lambda: False,
                 flush_wait_s: float = FLUSH_WAIT_S) -> None:
        self.producer = producer
        self.should_stop = should_stop
        self.flush_wait_s = flush_wait_s
        self.resent = 0
        self._sent: list[_Sent] = []

    @property
    def unconfirmed(self) -> int:
        return len(self._sent)

    def send(self, record: Outgoing, *, too_large: TooLarge | None = None) -> None:
        """Hand ``record`` to the producer; ``confirm()`` later makes sure it arrived."""
        try:
            future = retrying(lambda: self.producer.send(record.topic, key=record.key, value=record.value,
                                                         headers=record.headers or None),
                              f"send {record.what} to {record.topic}", should_stop=self.should_stop)
        except Exception as exc:
            if not is_too_large(exc):
                raise
            self._refused(record, exc, too_large)
            return
        self._sent.append(_Sent(record, future, too_large))

    def confirm(self) -> None:
        """Block until every record sent so far is acknowledged, re-sending what failed."""
        while self._sent:
            count = len(self._sent)
            retrying(lambda: self.producer.flush(timeout=self.flush_wait_s),
                     f"deliver {count} records", should_stop=self.should_stop)
            sent, self._sent = self._sent, []
            for item in sent:
                self._settle(item)

    def _settle(self, item: _Sent) -> None:
        future = item.future
        if not future.is_done:  # flush returned while the future is still open: look again next round
            self._sent.append(item)
        elif future.failed():
            exc = future.exception
            if is_too_large(exc):
                self._refused(item.record, exc, item.too_large)
            elif is_transient(exc):
                self.resent += 1
                logger.warning("re-sending %s to %s: delivery failed: %s", item.record.what, item.record.topic,
                               describe(exc))
                self.send(item.record, too_large=item.too_large)
            else:
                raise BrokerError(f"delivery of {item.record.what} to {item.record.topic} failed: "
                                  f"{describe(exc)}") from exc

    def _refused(self, record: Outgoing, exc: BaseException, too_large: TooLarge | None) -> None:
        if too_large is None:
            raise BrokerError(f"{record.what} to {record.topic} is over the size limit "
                              f"({len(record.value or b'')} bytes): {describe(exc)}") from exc
        replacement = too_large(record, exc)
        if replacement is not None:
            self.send(replacement, too_large=_lost)


def _lost(record: Outgoing, exc: BaseException) -> None:
    """A replacement refused for its size too (only with a limit below a few KB): say so loudly, go on."""
    logger.error("%s to %s refused for its size even without its value; not sent: %s", record.what, record.topic,
                 describe(exc))
    return None
