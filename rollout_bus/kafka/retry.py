"""Riding out broker outages: which Kafka errors are transient, and a retry loop with backoff.

Contract:

* ``is_transient(exc)``: True for errors that go away when the broker comes back: kafka-python's
  ``KafkaTimeoutError`` (also what 3.x raises when it cannot bootstrap), ``NoBrokersAvailable``
  (older kafka-python), ``KafkaConnectionError``, any ``KafkaError`` whose ``retriable`` is True
  (coordinator moves, leader elections, request timeouts), Python's ``ConnectionError`` and
  ``TimeoutError``, a ``BrokerError`` raised from one of these (``kafka.clients`` names the cluster
  it could not reach), and ``Unavailable`` (a condition a caller waits for, e.g. a topic with no
  partitions yet). False for everything else, in particular:

  - ``CommitFailedError``: kafka-python marks it non-retriable. A writer that assigns its
    partitions itself (no group membership) only gets it when another consumer is an active
    member of the same group id; retrying would hide two writers racing over one group.
  - record-size errors (``is_too_large``): sending the same bytes again fails the same way.

* ``is_too_large(exc)``: the producer (``MessageSizeTooLargeError`` at ``send``) or the broker
  (``MessageSizeTooLargeError`` / ``RecordListTooLargeError`` / ``RecordTooLargeError`` on the
  future) refused a record for its size.
* ``retrying(operation, what, should_stop=...)`` calls ``operation()`` until it returns. A
  transient error is logged as one WARNING per attempt, saying what it waits for
  (``waiting for broker: commit offsets (attempt 3, next in 4.0s): KafkaTimeoutError ...``),
  then it sleeps ``Backoff`` (0.5 s doubling to 10 s) and tries again, for as long as it takes.
  Any other error propagates at once. ``should_stop()`` is checked between attempts and while
  sleeping; when it turns true the loop raises ``Stopped`` (from the last error), so a SIGTERM
  still ends a process that waits for a broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kafka import errors as kafka_errors

from rollout_bus.errors import AccessDenied, BrokerError, MissingTopicError, Stopped, Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(kafka_errors, name, None) for name in
                    ("KafkaTimeoutError", "NoBrokersAvailable", "KafkaConnectionError", "NodeNotReadyError"))
    if cls is not None) + (ConnectionError, TimeoutError)
_TOO_LARGE: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(kafka_errors, name, None) for name in
                    ("MessageSizeTooLargeError", "RecordListTooLargeError", "RecordTooLargeError"))
    if cls is not None)
_NEVER: tuple[type[BaseException], ...] = (kafka_errors.CommitFailedError, AccessDenied) + _TOO_LARGE


def is_too_large(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it was raised from) refuses a record for its size."""
    while exc is not None:
        if isinstance(exc, _TOO_LARGE):
            return True
        exc = exc.__cause__
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether the operation that raised ``exc`` may succeed when tried again later (see module)."""
    if isinstance(exc, _NEVER):
        return False
    if isinstance(exc, (_TRANSIENT + (Unavailable,))):
        return True
    if isinstance(exc, BrokerError) and exc.__cause__ is not None:  # a client error the builders named
        return is_transient(exc.__cause__)
    return isinstance(exc, kafka_errors.KafkaError) and bool(getattr(exc, "retriable", False))


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait before attempt ``n + 1``: ``first_s * factor**(n-1)``, at most ``max_s``."""

    first_s: float = 0.5
    max_s: float = 10.0
    factor: float = 2.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.first_s * self.factor ** max(0, attempt - 1))


def describe(exc: BaseException) -> str:
    """``ClassName: message`` in one line, whatever the exception's own ``str`` looks like."""
    text = str(exc)
    name = type(exc).__name__
    text = text if name in text else f"{name}: {text}" if text else name
    return " ".join(text.split())[:500]


def retrying(operation: Callable[[], T], what: str, *, should_stop: Callable[[], bool] = lambda: False,
             backoff: Backoff = Backoff(), sleep: Callable[[float], None] = time.sleep,
             on_retry: Callable[[int, BaseException], None] | None = None) -> T:
    """``operation()``'s result, retried through transient errors for as long as it takes.

    Args:
        operation: the Kafka call (any callable without arguments).
        what: what is waited for, for the log line (``commit offsets``).
        should_stop: polled between attempts; True raises ``Stopped``.
        backoff: the waits between attempts.
        sleep: how to wait (tests pass a fake clock).
        on_retry: called with (attempt, error) before each wait, e.g. to count retries.

    Raises:
        Stopped: ``should_stop()`` turned true while waiting.
        Exception: the first error that ``is_transient`` does not accept, unchanged.
    """
    attempt = 0
    while True:
        try:
            return operation()
        except Exception as exc:  # noqa: BLE001 - classified right here; anything else re-raised
            if not is_transient(exc):
                raise
            attempt += 1
            delay = backoff.delay(attempt)
            if on_retry is not None:
                on_retry(attempt, exc)
            if isinstance(exc, MissingTopicError):  # the broker answers: the topic is what is missing
                logger.warning("waiting for a topic to be created: %s (attempt %d, next in %.1fs): %s; check "
                               "--topic-prefix, or create the run's topics (rollout-bus topics create)", what, attempt,
                               delay, describe(exc))
            else:
                logger.warning("waiting for broker: %s (attempt %d, next in %.1fs): %s", what, attempt, delay,
                               describe(exc))
            _sleep_unless_stopped(delay, should_stop, sleep, what, exc)


def _sleep_unless_stopped(delay: float, should_stop: Callable[[], bool], sleep: Callable[[float], None],
                          what: str, exc: BaseException) -> None:
    step = 0.25
    waited = 0.0
    while True:
        if should_stop():
            raise Stopped(f"stopped while waiting for the broker ({what})") from exc
        if waited >= delay:
            return
        sleep(min(step, delay - waited))
        waited += step
