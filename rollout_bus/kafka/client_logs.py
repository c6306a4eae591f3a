"""Kafka client logs during an outage: one line per kind of complaint every few seconds, not eighty.

aiokafka logs every failed reconnect and fetch (about 80 ERROR lines a second while a broker is
down, measured in a 2-minute outage), kafka-python much the same, some of it with a traceback each
time; that buries the stage's own "waiting for broker" lines. ``quiet_client_logs()`` puts a
``RepeatFilter`` on the root logger's handlers (call it once logging is configured), acting only on
those libraries' WARNING and worse records (a filter on a logger would miss its child loggers).

A kind of complaint is its call site and its exception: (logger, level, file, line, exception type).
Not the message text, which libraries build differently from release to release (kafka-python 3.0.12
formats many of its messages before logging them, so no two share a template). Each kind is let
through once per ``interval_s``, and the next one let through says how many were left out. A client
record's traceback is folded into its line (``...: KafkaConnectionError: [Errno 104] ...``) unless
``keep_tracebacks`` (``-v``): an operator needs the reason, not the library's frames. Nothing else
changes: levels, handlers and every first occurrence stay as they are.

``muted_client_logs()`` silences those libraries altogether for a block: a reachability probe (``kafka.admin``)
whose failure the caller says in its own words, so kafka-python's ERROR lines about the same failed
connect would only bury that one line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

CLIENT_LOGGERS = ("aiokafka", "kafka")
DEFAULT_INTERVAL_S = 10.0


class RepeatFilter(logging.Filter):
    """Lets a kind of client complaint through at most once per ``interval_s``; counts the rest."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock=time.monotonic, *,
                 keep_tracebacks: bool = False) -> None:
        super().__init__()
        self.interval_s, self.clock, self.keep_tracebacks = interval_s, clock, keep_tracebacks
        self._last: dict[tuple, float] = {}
        self._suppressed: dict[tuple, int] = {}

    @staticmethod
    def kind(record: logging.LogRecord) -> tuple:
        exc_type = record.exc_info[0] if record.exc_info else None
        return (record.name, record.levelno, record.pathname, record.lineno,
                exc_type.__name__ if exc_type is not None else "")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name.split(".", 1)[0] not in CLIENT_LOGGERS:
            return True
        key = self.kind(record)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        left_out = self._suppressed.pop(key, 0)
        if (record.exc_info and not self.keep_tracebacks) or left_out:
            message = record.getMessage()
            if record.exc_info and not self.keep_tracebacks:
                exc_type, exc = record.exc_info[0], record.exc_info[1]
                if exc_type is not None:
                    message = f"{message}: {exc_type.__name__}: {exc}"
                record.exc_info, record.exc_text = None, None
            if left_out:
                message = f"{message} ({left_out} more like this in the last {now - last:.0f}s)"
            record.msg, record.args = message, None
        return True


def quiet_client_logs(interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Install a ``RepeatFilter`` on each handler of the root logger (idempotent); client tracebacks are
    kept only when the root logger is at DEBUG (``-v``)."""
    keep = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(interval_s, keep_tracebacks=keep))


@contextmanager
def muted_client_logs() -> Iterator[None]:
    """The client libraries log nothing during the block (their loggers' levels are restored after it)."""
    loggers = [logging.getLogger(name) for name in CLIENT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
