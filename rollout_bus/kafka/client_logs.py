"""Kafka client logs during an outage: one line per kind of complaint every few seconds, not eighty.

aiokafka logs every failed reconnect and fetch (about 80 ERROR lines a second while a broker is
down, measured in a 2-minute outage), kafka-python much the same; that buries the stage's own
"waiting for broker" lines. ``quiet_client_logs()`` puts a ``RepeatFilter`` on the root logger's
handlers (call it once logging is configured), acting only on those libraries' records (a
filter on a logger would miss its child loggers): a message template (``record.msg``, before its arguments) is let through once per
``interval_s``, and the next one let through says how many were left out. Nothing else changes:
levels, handlers and every first occurrence stay as they are.
"""

from __future__ import annotations

import logging
import time

CLIENT_LOGGERS = ("aiokafka", "kafka")
DEFAULT_INTERVAL_S = 10.0


class RepeatFilter(logging.Filter):
    """Lets a message template through at most once per ``interval_s``; counts the rest."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock=time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name.split(".", 1)[0] not in CLIENT_LOGGERS:
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        left_out = self._suppressed.pop(key, 0)
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like this in the last {now - last:.0f}s)"
        return True


def quiet_client_logs(interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Install a ``RepeatFilter`` on each handler of the root logger (idempotent)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(interval_s))
