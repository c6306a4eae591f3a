"""Saying so while records wait for the broker, so a person never stares at a silent terminal.

Contract: ``PendingRecords`` counts the records a producer has handed to kafka-python and that the
broker has not yet answered (``sent`` on send, ``settled`` from the delivery callback, success or
failure), and knows what the caller is blocked in (``with pending.blocked("flush"):``). A
``BrokerWaitWatch`` thread looks at it once a second. While records are pending and none has been
answered for ``interval_s`` (10 s), or a caller has been blocked that long with nothing pending
(kafka-python waiting for metadata), it logs one WARNING every ``interval_s``:

    waiting for broker: topic=rollout.turns 123 records (4.1 MB) unacknowledged, none answered for 30s, blocked in flush

and hands a ``BrokerWait`` to ``on_wait`` (the generate progress line shows it). Once answers
come again it logs one INFO line and calls ``on_wait(None)``. ``wait_for_room(size, limit)`` blocks a
sender while more than ``limit`` bytes are pending (kafka-python 3 has no bounded buffer of its own:
without this a long outage would hold every generated record in memory).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WAIT_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class BrokerWait:
    """What is waiting: how long nothing was answered, what is pending, what the caller is blocked in."""

    topic: str
    waited_s: float
    records: int
    bytes: int
    blocked_in: str | None

    def describe(self) -> str:
        where = f", blocked in {self.blocked_in}" if self.blocked_in else ""
        return (f"topic={self.topic} {self.records} records ({self.bytes / 1e6:.1f} MB) unacknowledged, "
                f"none answered for {self.waited_s:.0f}s{where}")


WaitFn = Callable[[BrokerWait | None], None]


class PendingRecords:
    """Records sent and not yet answered, and what a caller is blocked in; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.records = 0
        self.bytes = 0
        self.last_answer = time.monotonic()  # of the last answer, or of the first send after none pending
        self._blocked: dict[int, tuple[str, float]] = {}

    def sent(self, size: int) -> None:
        with self._cond:
            if self.records == 0:
                self.last_answer = time.monotonic()  # the stall clock starts when something is pending
            self.records += 1
            self.bytes += size

    def settled(self, size: int, _outcome: object = None) -> None:
        """Delivery callback (kafka-python's I/O thread): the broker answered one record."""
        with self._cond:
            self.records -= 1
            self.bytes -= size
            self.last_answer = time.monotonic()
            self._cond.notify_all()

    @contextmanager
    def blocked(self, what: str) -> Iterator[None]:
        token = object()
        with self._cond:
            self._blocked[id(token)] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._cond:
                self._blocked.pop(id(token), None)

    def wait_for_room(self, size: int, limit: int) -> None:
        """Block while ``limit`` bytes would be exceeded (a record alone may exceed it)."""
        with self._cond:
            if self.bytes == 0 or self.bytes + size <= limit:
                return
        with self.blocked("send (producer buffer full)"), self._cond:
            while self.bytes and self.bytes + size > limit:
                self._cond.wait(1.0)

    def stall(self, topic: str, now: float) -> BrokerWait:
        """How long the broker has kept us waiting: since its last answer while records are pending,
        else since a caller blocked (0 when neither)."""
        with self._cond:
            blocked = min(self._blocked.values(), key=lambda b: b[1], default=None)
            if self.records:  # a long flush that the broker keeps answering is not a wait
                waited = now - self.last_answer
            else:  # blocked with nothing pending: kafka-python waits for metadata
                waited = now - blocked[1] if blocked is not None else 0.0
            return BrokerWait(topic, waited, self.records, self.bytes, blocked[0] if blocked else None)


class BrokerWaitWatch:
    """A daemon thread that logs (and reports) waits longer than ``interval_s``; ``close()`` stops it.

    ``thread=False`` starts no thread: the owner calls ``check`` (tests do, with a clock of their own).
    """

    def __init__(self, pending: PendingRecords, topic: str, on_wait: WaitFn | None = None,
                 interval_s: float = WAIT_LOG_INTERVAL_S, *, thread: bool = True) -> None:
        self.pending, self.topic, self.on_wait, self.interval_s = pending, topic, on_wait, interval_s
        self._stop = threading.Event()
        self._waiting_since_log: float | None = None  # monotonic time of the last WARNING of this wait
        self._thread = threading.Thread(target=self._run, name=f"broker-wait-{topic}", daemon=True)
        if thread:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s)):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One look (the thread calls it every second; tests call it directly)."""
        wait = self.pending.stall(self.topic, now)
        if wait.waited_s >= self.interval_s:
            if self._waiting_since_log is None or now - self._waiting_since_log >= self.interval_s:
                self._waiting_since_log = now
                logger.warning("waiting for broker: %s", wait.describe())
                self._report(wait)
        elif self._waiting_since_log is not None:
            self._waiting_since_log = None
            logger.info("broker answering again topic=%s pending_records=%d", self.topic, wait.records)
            self._report(None)

    def _report(self, wait: BrokerWait | None) -> None:
        if self.on_wait is None:
            return
        try:
            self.on_wait(wait)
        except Exception:  # a display callback must never take the producer down
            logger.exception("on_wait callback failed topic=%s", self.topic)

    def close(self) -> None:
        """Stop watching; a wait that was reported and is over by now is reported over (a last look)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
            self.check(time.monotonic())

