"""Kafka client log noise during an outage is thinned to one line per template and interval."""

from __future__ import annotations

import logging

from rollout_bus.kafka.client_logs import RepeatFilter


def _record(name: str, msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, ("127.0.0.1",), None)


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


def test_other_loggers_other_templates_and_info_lines_are_untouched():
    keep = RepeatFilter(10.0, clock=lambda: 0.0)
    assert all(keep.filter(_record("rollout_bus.stream.app", "waiting %s")) for _ in range(3))
    assert all(keep.filter(_record("aiokafka", "joined %s", logging.INFO)) for _ in range(3))
    assert keep.filter(_record("kafka.client", "a %s")) and keep.filter(_record("kafka.client", "b %s"))
    assert not keep.filter(_record("kafka.client", "a %s"))
