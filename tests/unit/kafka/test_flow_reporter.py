"""FlowReporter: the first report goes at once, later ones at most every every_s, the final one always and
confirmed; a refused send is one ERROR line and no more sends, never an error in the stage."""

from __future__ import annotations

import json
import logging

import pytest

from rollout_bus.errors import AccessDenied, BrokerError
from rollout_bus.kafka import flow_reporter
from rollout_bus.kafka.flow_reporter import FlowReporter
from rollout_bus.wire.topics import Topics


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


class Sent:
    def __init__(self, sent, confirmed):
        self.sent, self.confirmed = sent, confirmed

    def get(self, timeout):
        self.confirmed.append(self.sent)


class FakeProducer:
    def __init__(self):
        self.sent, self.confirmed, self.closed = [], [], False

    def send(self, topic, key, value):
        self.sent.append((topic, key, json.loads(value)))
        return Sent(self.sent[-1], self.confirmed)

    def close(self):
        self.closed = True


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(flow_reporter.time, "monotonic", clock.monotonic)
    return clock


def test_reports_are_spaced_by_every_s_and_the_final_one_always_goes_and_is_confirmed(clock, monkeypatch):
    producer = FakeProducer()
    monkeypatch.setattr(flow_reporter, "new_producer", lambda conn, **kw: producer)
    reporter = FlowReporter({"bootstrap_servers": "x"}, Topics("run."), "trainer", "trainer", every_s=5.0)
    clock.now += 1.0
    assert reporter.report({"flow/trainer/wait_s": 1.0})
    clock.now += 4.0
    assert not reporter.report({"flow/trainer/wait_s": 2.0})
    clock.now += 1.0
    assert reporter.report({"flow/trainer/wait_s": 3.0})
    assert reporter.report({"flow/trainer/wait_s": 3.5}, final=True)
    reporter.close()
    assert [(t, k, d["elapsed_s"], d["final"], d["metrics"]["rollout/flow/trainer/wait_s"]) for t, k, d in producer.sent] == [
        ("run.rollout.metrics", b"flow:trainer:trainer", 1.0, False, 1.0),
        ("run.rollout.metrics", b"flow:trainer:trainer", 6.0, False, 3.0),
        ("run.rollout.metrics", b"flow:trainer:trainer", 6.0, True, 3.5)]
    assert producer.confirmed == producer.sent[-1:] and producer.closed


def test_a_refused_reporter_says_so_once_and_the_stage_goes_on(clock, monkeypatch, caplog):
    def refused(conn, **kw):
        raise AccessDenied("writing to rollout.metrics as 'generator' was refused: check its ACLs")

    monkeypatch.setattr(flow_reporter, "new_producer", refused)
    reporter = FlowReporter({"bootstrap_servers": "x"}, Topics(), "generator", "g0of1-seed0")
    with caplog.at_level(logging.ERROR, logger="rollout_bus.kafka.flow_reporter"):
        assert not reporter.report({}) and not reporter.report({}, final=True)
    assert [r.getMessage() for r in caplog.records] == [
        "generator flow metrics are not reported from here on (the generator goes on): writing to rollout.metrics "
        "as 'generator' was refused: check its ACLs"]
    reporter.close()


def test_a_cluster_that_is_away_is_tried_again_when_the_next_report_is_due(clock, monkeypatch, caplog):
    producer, attempts = FakeProducer(), []

    def away_once(conn, **kw):
        attempts.append(clock.now)
        if len(attempts) == 1:
            raise BrokerError("cannot create a producer for bootstrap_servers='x': no broker answers")
        return producer

    monkeypatch.setattr(flow_reporter, "new_producer", away_once)
    reporter = FlowReporter({"bootstrap_servers": "x"}, Topics(), "trainer", "trainer", every_s=5.0)
    with caplog.at_level(logging.WARNING, logger="rollout_bus.kafka.flow_reporter"):
        assert not reporter.report({"flow/trainer/wait_s": 1.0})
        clock.now += 1.0
        assert not reporter.report({"flow/trainer/wait_s": 2.0})  # not due yet: not tried
        clock.now += 5.0
        assert reporter.report({"flow/trainer/wait_s": 3.0})
    assert attempts == [100.0, 106.0] and reporter.failed == 1 and len(producer.sent) == 1
    assert "tried again in 5s" in caplog.records[0].getMessage()
