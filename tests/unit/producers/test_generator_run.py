"""A generator's run, wired by the producers stage from plain values: the run's batching held, the weights
followed, the gate on the run's batching, the publisher and the flow records, and everything closed."""

from __future__ import annotations

import pytest

import rollout_bus.producers.generator_run as generator_run
from rollout_bus.producers.generator_run import GeneratorHooks, GeneratorOptions, prepare_run, run_generator
from rollout_bus.producers.run import GenerateSummary
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.topics import Topics
from tests.unit.producers.test_staleness_gate import FakeWatcher

CONN = {"bootstrap_servers": "broker:9092", "security_protocol": "PLAINTEXT"}


def options(max_staleness: int | None = 1, follow_weights: bool = False) -> GeneratorOptions:
    return GeneratorOptions(generator_id="g0of1-seed3", run_batching=RunBatching(2, "step", max_staleness),
                            follow_weights=follow_weights, policy_version=5, delivery_timeout_s=60.0,
                            max_record_bytes=2 << 20)


class FakePublisher:
    def __init__(self, bootstrap, **kwargs) -> None:
        self.bootstrap, self.kwargs, self.closed = bootstrap, kwargs, False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True


class FakeFlow:
    def __init__(self, conn, topics, stage, source) -> None:
        self.stage, self.source, self.reports, self.closed, self.elapsed_s = stage, source, [], False, 1.0

    def report(self, metrics, *, final=False) -> None:
        self.reports.append(final)

    def close(self) -> None:
        self.closed = True


class ClosingWatcher(FakeWatcher):
    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def wired(monkeypatch):
    made: dict = {}
    monkeypatch.setattr(generator_run, "TurnPublisher",
                        lambda bootstrap, **kw: made.setdefault("publisher", FakePublisher(bootstrap, **kw)))
    monkeypatch.setattr(generator_run, "FlowReporter", lambda *a: made.setdefault("flow", FakeFlow(*a)))

    def open_watcher(conn, topics, *, initial):
        made["watcher_conn"] = conn
        return made.setdefault("watcher", ClosingWatcher(version=initial))

    made["open_watcher"] = open_watcher
    return made


def test_a_bounded_run_follows_the_weights_through_a_gate_on_the_runs_batching(wired):
    seen, told, shown = {}, [], []

    def publish(publisher, watcher, gate, progress):
        seen.update(publisher=publisher, watcher=watcher, gate=gate)
        summary = GenerateSummary(run_id="r")
        progress(summary)
        return summary

    hooks = GeneratorHooks(progress=shown.append, following=told.append, broker_wait=lambda wait: None)
    summary, seconds = run_generator(CONN, Topics(prefix="p."), options(), publish,
                                     open_watcher=wired["open_watcher"], hooks=hooks)
    assert summary.run_id == "r" and seconds >= 0
    gate = seen["gate"]
    assert gate.run == RunBatching(2, "step", 1) and gate.required(4) == 1  # batch 2, bound 1
    assert seen["watcher"] is wired["watcher"] and wired["watcher"].version == 5  # from policy_version
    assert told == [5] and len(shown) == 2  # the live version it starts from; each turn's progress, then the end
    publisher = wired["publisher"]
    assert publisher.bootstrap == "broker:9092" and "bootstrap_servers" not in publisher.kwargs
    assert publisher.kwargs["topic"] == "p.rollout.turns" and publisher.kwargs["generator"] == "g0of1-seed3"
    assert (publisher.kwargs["delivery_timeout_s"], publisher.kwargs["max_record_bytes"]) == (60.0, 2 << 20)
    assert publisher.kwargs["on_wait"] is hooks.broker_wait and publisher.closed
    flow = wired["flow"]
    assert (flow.stage, flow.source) == ("generator", "g0of1-seed3")
    assert flow.reports == [False, False, True] and flow.closed and wired["watcher"].closed


def test_without_a_bound_or_following_there_is_no_watcher_and_no_gate(wired):
    seen = {}

    def publish(publisher, watcher, gate, progress):
        seen.update(watcher=watcher, gate=gate)
        return GenerateSummary(run_id="r")

    run_generator(CONN, Topics(), options(max_staleness=None), publish, open_watcher=wired["open_watcher"])
    assert seen == {"watcher": None, "gate": None} and "watcher" not in wired
    assert wired["flow"].reports == [False, True] and wired["flow"].closed


def test_the_watcher_and_the_flow_reporter_are_closed_when_publishing_fails(wired):
    def publish(publisher, watcher, gate, progress):
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        run_generator(CONN, Topics(), options(max_staleness=None, follow_weights=True), publish,
                      open_watcher=wired["open_watcher"])
    assert wired["watcher"].closed and wired["flow"].closed and wired["publisher"].closed


@pytest.mark.parametrize("bound, declared", [(1, True), (None, False)])
def test_a_run_is_held_to_one_batching_only_when_the_gate_counts_batches(monkeypatch, bound, declared):
    calls = []
    monkeypatch.setattr(generator_run, "wait_for_cluster", lambda conn, timeout: calls.append(("wait", timeout)))
    monkeypatch.setattr(generator_run, "ensure_topics", lambda conn, topics, **kw: calls.append(("topics", kw)))
    monkeypatch.setattr(generator_run, "check_run_batching", lambda conn, topics, ours: calls.append(("run", ours)))
    prepare_run(CONN, Topics(), options(max_staleness=bound))
    assert calls[:2] == [("wait", 60.0), ("topics", {"max_record_bytes": 2 << 20})]
    if declared:
        ours = calls[2][1]
        assert ours.differences(RunBatching(2, "step", 1)) == [] and ours.declared_by.startswith("generator@")
    assert len(calls) == 2 + declared
