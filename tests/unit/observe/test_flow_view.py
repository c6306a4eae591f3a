"""Flow records and batch flow keys through the view into Prometheus series: the latest record of each source
wins, batch totals count each batch once, seconds are said in full, fractions are gauges."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rollout_bus.errors import ContractError
from rollout_bus.observe.exporter import SnapshotCollector
from rollout_bus.observe.metrics_view import MetricsView
from rollout_bus.wire.flow_metrics import flow_key, flow_metrics_record, generator_flow, trainer_flow
from rollout_bus.wire.metrics_records import batch_metrics_record


def _exposition(view: MetricsView) -> dict[str, float]:
    collector = SnapshotCollector()
    collector.update(view.snapshot())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    rows = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            rows[name] = float(value)
    return rows


def test_the_latest_flow_record_of_each_source_is_served_by_source():
    view = MetricsView()
    view.add_metrics(flow_metrics_record("trainer", "trainer", trainer_flow(1.0, 1, 4.0), elapsed_s=4.0, final=False))
    view.add_metrics(flow_metrics_record("trainer", "trainer", trainer_flow(6.0, 5, 12.0), elapsed_s=12.0, final=True))
    view.add_metrics(flow_metrics_record("generator", "g0of2-seed1", generator_flow(3.0, 2, 12.0), elapsed_s=12.0,
                                         final=False))
    view.add_metrics(flow_metrics_record("generator", "g1of2-seed1", generator_flow(0.0, 0, 12.0), elapsed_s=12.0,
                                         final=False))
    sources = view.snapshot()["flow"]["sources"]
    assert [(r["stage"], r["source"], r["final"]) for r in sources] == [
        ("generator", "g0of2-seed1", False), ("generator", "g1of2-seed1", False), ("trainer", "trainer", True)]
    rows = _exposition(view)
    assert rows['rollout_flow_trainer_wait_seconds_total{source="trainer"}'] == 6.0
    assert rows['rollout_flow_trainer_wait_fraction{source="trainer"}'] == 0.5
    assert rows['rollout_flow_trainer_steps_total{source="trainer"}'] == 5.0
    assert rows['rollout_flow_generator_gate_blocked_fraction{source="g0of2-seed1"}'] == 0.25
    assert rows['rollout_flow_generator_gate_blocked_seconds_total{source="g1of2-seed1"}'] == 0.0


def test_batch_flow_totals_count_a_re_announced_batch_once_and_the_latest_batch_gives_the_gauges():
    view = MetricsView()
    for seq, stale in ((0, 4.0), (1, 6.0), (1, 6.0)):
        view.add_metrics(batch_metrics_record(seq, {"flow/response_tokens": 50.0, "flow/discarded_tokens/stale": stale,
                                                    "flow/sample_age_s/p99": 1.5 + seq}, samples=2, manifest_path="m"))
    assert view.snapshot()["flow"]["batch_totals"] == {"rollout/flow/discarded_tokens/stale": 10.0,
                                                      "rollout/flow/response_tokens": 100.0}
    rows = _exposition(view)
    assert rows['rollout_flow_discarded_tokens_total{cause="stale"}'] == 10.0
    assert rows["rollout_flow_response_tokens_total"] == 100.0
    assert rows['rollout_flow_sample_age_s_p99{adapter="",kind="batch"}'] == 2.5


def test_a_flow_record_says_its_stage_and_source_and_refuses_another_stage():
    doc = json.loads(flow_metrics_record("generator", "g0of1-seed7", generator_flow(2.0, 1, 8.0), elapsed_s=8.0,
                                         final=True))
    assert doc["metrics"]["rollout/flow/generator/gate_blocked_fraction"] == 0.25 and doc["final"] is True
    assert flow_key("generator", "g0of1-seed7") == b"flow:generator:g0of1-seed7"
    with pytest.raises(ContractError, match="stage"):
        flow_metrics_record("stream", "w1", {}, elapsed_s=1.0, final=False)


def test_fractions_stay_within_zero_and_one():
    assert trainer_flow(5.0, 1, 0.0)["flow/trainer/wait_fraction"] == 0.0
    assert generator_flow(5.0, 1, 4.9)["flow/generator/gate_blocked_fraction"] == 1.0


def test_tail_shows_who_waits_and_the_latest_batchs_age_and_discards():
    from rich.console import Console

    from rollout_bus.cli.tail import render

    view = MetricsView()
    view.add_metrics(flow_metrics_record("generator", "g0of1-seed7", generator_flow(3.0, 2, 12.0), elapsed_s=12.0,
                                         final=False))
    view.add_metrics(flow_metrics_record("trainer", "trainer", trainer_flow(6.0, 5, 12.0), elapsed_s=12.0, final=True))
    view.add_metrics(batch_metrics_record(3, {"flow/sample_age_s/p50": 1.25, "flow/sample_age_s/p99": 4.5,
                                              "flow/discarded_token_fraction/stale": 0.125}, samples=2,
                                          manifest_path="m"))
    console = Console(width=160, record=True, color_system=None)
    console.print(render(view.snapshot()))
    text = console.export_text()
    assert "batch 3: age p50 s 1.25, age p99 s 4.5, stale 0.125 (token fractions)" in " ".join(text.split())
    assert [line.split() for line in text.splitlines() if line.startswith(("│ generator", "│ trainer"))] == [
        ["│", "generator", "│", "g0of1-seed7", "│", "3", "│", "0.250", "│", "12", "│", "no", "│"],
        ["│", "trainer", "│", "trainer", "│", "6", "│", "0.500", "│", "12", "│", "yes", "│"]]


def test_the_report_folds_each_batchs_flow_and_the_latest_record_of_each_source():
    from rollout_bus.observe.flow_fold import fold_flow

    docs = [json.loads(v) for v in (
        flow_metrics_record("trainer", "trainer", trainer_flow(1.0, 1, 2.0), elapsed_s=2.0, final=False),
        batch_metrics_record(0, {"flow/response_tokens": 10.0, "response_len/mean": 3.0}, samples=1, manifest_path="m"),
        batch_metrics_record(1, {"response_len/mean": 3.0}, samples=1, manifest_path="m"),  # an older writer: no flow
        flow_metrics_record("trainer", "trainer", trainer_flow(5.0, 4, 10.0), elapsed_s=10.0, final=True))]
    flow = fold_flow(docs)
    assert flow.batches == {0: {"flow/response_tokens": 10.0}}
    assert [(s["source"], s["final"], s["metrics"]["flow/trainer/wait_s"]) for s in flow.sources] == [
        ("trainer", True, 5.0)]


def test_a_trainer_of_some_ranks_is_its_own_source():
    from types import SimpleNamespace

    from rollout_bus.consumers.feed.training import trainer_source

    def feeds(*ranks):
        return {r: SimpleNamespace(dp_size=4) for r in ranks}
    assert trainer_source(feeds(0, 1, 2, 3)) == "trainer" and trainer_source(feeds(2, 3)) == "trainer-ranks-2-3"


def test_tail_says_how_many_groups_were_written_short_summed_over_batches():
    from rich.console import Console

    from rollout_bus.cli.tail import render

    view = MetricsView()
    for seq, short in ((0, 0.0), (1, 2.0), (2, 1.0)):
        view.add_metrics(batch_metrics_record(seq, {"flow/incomplete_groups": short}, samples=2, manifest_path="m"))
    console = Console(width=160, record=True, color_system=None)
    console.print(render(view.snapshot()))
    assert "3 groups written short (manifest complete: false)" in " ".join(console.export_text().split())
    quiet = MetricsView()
    quiet.add_metrics(batch_metrics_record(0, {"flow/incomplete_groups": 0.0}, samples=2, manifest_path="m"))
    console = Console(width=160, record=True, color_system=None)
    console.print(render(quiet.snapshot()))
    assert "written short" not in console.export_text()
