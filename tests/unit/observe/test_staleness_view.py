"""Staleness in the operator's views: the snapshot, ``tail``'s table, the exporter's gauges, the report."""

from __future__ import annotations

import json

from rich.console import Console

from rollout_bus.cli.tail import render
from rollout_bus.observe.exporter import snapshot_families
from rollout_bus.observe.metrics_view import MetricsView, staleness_rows
from rollout_bus.observe.report import RawRun, build_report, fold_batches
from rollout_bus.observe.report_html import render_html
from rollout_bus.wire.metrics_records import batch_metrics_record
from rollout_bus.wire.weight_version import WeightVersion
from rollout_bus.wire.topics import Topics

SCOPED = {"adapter/math/staleness/mean": 0.5, "adapter/math/staleness/max": 1.0, "adapter/math/staleness/oldest": 2.0,
          "adapter/code/staleness/mean": 1.25, "adapter/code/staleness/max": 3.0,
          "adapter/code/staleness/oldest": 3.0, "response_len/mean": 7.0}


def view_with_batch(metrics: dict, seq: int = 4, adapter: str | None = None) -> MetricsView:
    view = MetricsView(adapter)
    view.add_metrics(batch_metrics_record(seq, metrics, samples=6, manifest_path="/m.json"))
    return view


def shown(snapshot: dict) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(render(snapshot))
    return console.export_text()


def test_staleness_rows_gather_each_scope_unscoped_first_and_leave_other_metrics_out():
    rows = staleness_rows({f"rollout/{k}": v for k, v in SCOPED.items()}
                          | {"rollout/staleness/mean": 0.0, "rollout/staleness/max": 0.0})
    assert rows == [{"adapter": None, "mean": 0.0, "max": 0.0, "oldest": None},
                    {"adapter": "code", "mean": 1.25, "max": 3.0, "oldest": 3.0},
                    {"adapter": "math", "mean": 0.5, "max": 1.0, "oldest": 2.0}]
    assert staleness_rows({"response_len/mean": 1.0, "staleness/other": 2.0}) == []


def test_the_snapshot_carries_the_latest_batch_staleness_and_the_trainer_version():
    view = view_with_batch(SCOPED)
    snapshot = view.snapshot(weights=WeightVersion(5, 4, 1_700_000_000_000))
    assert [r["adapter"] for r in snapshot["staleness"]] == ["code", "math"]
    assert snapshot["trainer"] == {"weight_version": 5, "step": 4, "published_at": 1_700_000_000_000}
    json.dumps(snapshot)
    assert view_with_batch(SCOPED, adapter="math").snapshot()["staleness"] == [
        {"adapter": "math", "mean": 0.5, "max": 1.0, "oldest": 2.0}]
    empty = MetricsView().snapshot()
    assert empty["staleness"] == [] and empty["trainer"] == {"weight_version": None, "step": None,
                                                             "published_at": None}


def test_tail_shows_the_trainer_version_and_staleness_per_adapter_or_a_dash():
    text = shown(view_with_batch(SCOPED).snapshot(weights=WeightVersion(5, 4, 0)))
    assert "trainer weight version 5; staleness of batch 4" in text
    rows = [line.replace("│", " ").split() for line in text.splitlines()]
    assert ["code", "1.25", "3", "3"] in rows and ["math", "0.500", "1", "2"] in rows
    assert "trainer weight version -; staleness of batch -" in shown(MetricsView().snapshot())


def test_the_exporter_serves_the_trainer_version_and_the_staleness_gauges_per_adapter():
    families = {f.name: f for f in snapshot_families(view_with_batch(SCOPED).snapshot(weights=WeightVersion(5, 4, 0)))}
    assert [s.value for s in families["rollout_trainer_weight_version"].samples] == [5.0]
    maxes = {(s.labels["adapter"], s.labels["kind"]): s.value for s in families["rollout_staleness_max"].samples}
    assert maxes == {("math", "batch"): 1.0, ("code", "batch"): 3.0}
    assert "rollout_staleness_oldest" in families and "rollout_staleness_mean" in families
    without = {f.name for f in snapshot_families(view_with_batch(SCOPED).snapshot())}
    assert "rollout_trainer_weight_version" not in without  # no version known: no series


def test_the_report_shows_staleness_per_batch_from_manifests_and_metrics_records():
    manifest = {"seq": 1, "num_samples": 2, "metrics": {"staleness/mean": 0.5, "staleness/max": 1.0,
                                                        "staleness/oldest": 2.0},
                "extra": {"partial": False, "groups": [], "episodes": []}}
    doc = json.loads(batch_metrics_record(2, SCOPED, samples=3, manifest_path="/b2/manifest.json"))
    rows = fold_batches([manifest], [], [doc])
    assert rows[0].staleness == ({"adapter": None, "mean": 0.5, "max": 1.0, "oldest": 2.0},)
    assert [r["adapter"] for r in rows[1].staleness] == ["code", "math"]
    page = render_html(build_report(RawRun(metrics=[doc], announcements=[manifest]), Topics(prefix="r.")))
    assert "staleness mean / max / oldest" in page and "0.50 / 1.0 / 2.0" in page and "code: 1.25 / 3.0 / 3.0" in page
