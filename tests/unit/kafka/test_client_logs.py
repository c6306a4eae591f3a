"""Kafka client log noise during an outage is thinned to one line per kind of complaint (call site and
exception type, whatever the message text) and interval, and a client's traceback becomes part of its line."""

from __future__ import annotations

import logging
import sys

from rollout_bus.kafka.client_logs import RepeatFilter


def _record(name: str, msg: str, level: int = logging.ERROR, *, line: int = 1, args=("127.0.0.1",),
            exc_info=None) -> logging.LogRecord:
    return logging.LogRecord(name, level, "/site-packages/kafka/net/transport.py", line, msg, args, exc_info)


def _exc_info(exc: BaseException):
    try:
        raise exc
    except BaseException:
        return sys.exc_info()


def test_a_repeated_client_error_passes_once_per_interval_and_then_says_how_many_were_left_out():
    now = [0.0]
    keep = RepeatFilter(10.0, clock=lambda: now[0])
    template = "Unable connect to node %s"
    passed = []
    for step in range(25):  # one error every second for 25 s
        now[0] = float(step)
        record = _record("aiokafka.conn", template)
        if keep.filter(record):
            passed.append((step, record.getMessage()))
    assert [step for step, _ in passed] == [0, 10, 20]
    assert passed[1][1] == "Unable connect to node 127.0.0.1 (9 more like this in the last 10s)"


def test_messages_formatted_before_logging_are_one_kind_when_they_come_from_one_call_site():
    """kafka-python 3.0.12 logs f-strings: every message text differs, the call site does not."""
    now = [0.0]
    keep = RepeatFilter(10.0, clock=lambda: now[0])
    passed = []
    for step in range(12):
        now[0] = float(step)
        record = _record("kafka.net.transport", f"<Transport node_id={step} host=127.0.0.1:{40000 + step}>: "
                         "Error receiving network data closing socket", args=None, line=125)
        if keep.filter(record):
            passed.append(record.getMessage())
    assert len(passed) == 2 and passed[1].endswith("(9 more like this in the last 10s)")
    # another call site of the same logger is another kind
    assert keep.filter(_record("kafka.net.transport", "something else", args=None, line=445))


def test_a_client_traceback_becomes_one_line_naming_the_exception_unless_asked_to_keep_it():
    keep = RepeatFilter(10.0, clock=lambda: 0.0)
    record = _record("kafka.net.transport", "%s: Error receiving network data closing socket", args=("<conn>",),
                     exc_info=_exc_info(ConnectionResetError(104, "Connection reset by peer")))
    assert keep.filter(record)
    line = logging.Formatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert "Traceback" not in line and "\n" not in line
    assert line.endswith("<conn>: Error receiving network data closing socket: ConnectionResetError: "
                         "[Errno 104] Connection reset by peer")
    verbose = RepeatFilter(10.0, clock=lambda: 0.0, keep_tracebacks=True)
    kept = _record("kafka.net.transport", "%s: boom", args=("<conn>",), exc_info=_exc_info(ValueError("x")))
    assert verbose.filter(kept)
    assert "Traceback" in logging.Formatter("%(message)s").format(kept)


def test_the_same_call_site_with_another_exception_is_another_kind():
    keep = RepeatFilter(10.0, clock=lambda: 0.0)
    assert keep.filter(_record("kafka.conn", "failed", args=None, exc_info=_exc_info(TimeoutError())))
    assert keep.filter(_record("kafka.conn", "failed", args=None, exc_info=_exc_info(ConnectionError())))
    assert not keep.filter(_record("kafka.conn", "failed", args=None, exc_info=_exc_info(TimeoutError())))


def test_other_loggers_other_templates_and_info_lines_are_untouched():
    keep = RepeatFilter(10.0, clock=lambda: 0.0)
    assert all(keep.filter(_record("rollout_bus.streams.app", "waiting %s")) for _ in range(3))
    assert all(keep.filter(_record("aiokafka", "joined %s", logging.INFO)) for _ in range(3))
    assert keep.filter(_record("kafka.client", "a %s", line=1)) and keep.filter(_record("kafka.client", "b %s", line=2))
    assert not keep.filter(_record("kafka.client", "a %s", line=1))
    own = _record("rollout_bus.consumers.shard_writer", "failed", exc_info=_exc_info(ValueError("x")))
    assert keep.filter(own) and own.exc_info is not None  # our own tracebacks stay
