"""What queries Prometheus (the alert rules, compose/prometheus/alerts.yml, and the Grafana dashboard's panels)
asks only for series the exporter serves, and Prometheus loads the rules.

``promtool`` itself checks and unit-tests the rules (compose/prometheus/check-rules.sh, run by ``make test``); this
ties them and the panels to the exporter: a rule or a panel on a series that was renamed or never existed would
stay silent or empty, and promtool's own tests, which feed the series by name, could not tell.
"""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client import CollectorRegistry, generate_latest

from rollout_bus.kafka.lag import lag_rows
from rollout_bus.observe.exporter import SnapshotCollector
from rollout_bus.observe.metrics_view import MetricsView
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.flow_metrics import DISCARD_CAUSES, flow_metrics_record, generator_flow, trainer_flow
from rollout_bus.wire.metrics_records import batch_metrics_record, window_metrics_record
from rollout_bus.wire.weight_version import WeightVersion
from tests.unit.compose.test_compose import BASE, COMPOSE, load

PROMETHEUS = COMPOSE / "prometheus"


def batch_flow_example() -> dict[str, float]:
    """The flow keys a written batch's record carries (``rollout_bus.consumers.shard_writer.flow.batch_flow``)."""
    return {"flow/sample_age_s/p50": 2.0, "flow/sample_age_s/p99": 9.0, "flow/sample_age_s/max": 10.0,
            "flow/response_tokens": 100.0, "flow/discarded_token_fraction": 0.3,
            **{f"flow/discarded_tokens/{c}": 10.0 for c in DISCARD_CAUSES},
            **{f"flow/discarded_token_fraction/{c}": 0.1 for c in DISCARD_CAUSES}}


def _served_series() -> set[str]:
    """Every series name in the exporter's exposition of a run with windows, a batch, dead letters, lag, a trainer."""
    view = MetricsView()
    view.add_metrics(window_metrics_record(0, 1000, "math", {"episode_raw_reward": 0.5}, episodes=2, closed=True))
    view.add_metrics(batch_metrics_record(0, {"episode_raw_reward": 0.5, "staleness/mean": 0.5, "staleness/max": 1.0,
                                              "staleness/oldest": 1.0,
                                              **{f"episode_response_length/{s}": 3.0
                                                 for s in ("mean", "median", "min", "max")},
                                              **batch_flow_example()},
                                          samples=2, manifest_path="m"))
    view.add_dead_letter(DeadLetter(b"k", b"v", [], "bad", "stream", "decode", "t:0:1"))
    view.add_metrics(flow_metrics_record("generator", "g0of1-seed7", generator_flow(3.0, 2, 10.0), elapsed_s=10.0,
                                         final=False))
    view.add_metrics(flow_metrics_record("trainer", "trainer", trainer_flow(4.0, 3, 10.0), elapsed_s=10.0, final=False))
    lag = [row.to_json() for row in lag_rows("g", "t", ends={0: 10}, begins={0: 2}, committed={0: 1})]
    collector = SnapshotCollector()
    snapshot = view.snapshot(lag=lag, weights=WeightVersion(1, 1, 0))
    snapshot["run"] = {"groups_per_batch": 2, "batching": "step", "max_staleness": 2}  # MetricsFeed adds it
    collector.update(snapshot)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_series_an_alert_queries_is_one_the_exporter_serves():
    rules = [r for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    served = _served_series()
    queried = {name for rule in rules for name in re.findall(r"\brollout_[a-z0-9_]+\b", rule["expr"])}
    assert queried and queried <= served, f"queried but not served: {sorted(queried - served)}"
    jobs = {job["job_name"] for job in yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]}
    for rule in rules:
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in jobs, f"{rule['alert']} watches job {job!r}, prometheus.yml scrapes {sorted(jobs)}"


def test_prometheus_loads_the_rules_the_compose_profile_mounts():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    prometheus = load(BASE)["services"]["prometheus"]
    mounted = {str(v).split(":")[1] for v in prometheus["volumes"]}
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"] and "/etc/prometheus/alerts.yml" in mounted
    tests = yaml.safe_load((PROMETHEUS / "alerts-test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    firing = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    rules = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert tested == firing == rules, "every rule needs a test where it fires and one where it must not"


def test_every_series_a_dashboard_panel_queries_is_one_the_exporter_serves():
    dashboard = json.loads((COMPOSE / "grafana" / "dashboards" / "rollout-bus.json").read_text())
    served = _served_series()
    for panel in dashboard["panels"]:
        queried = {name for target in panel["targets"] for name in re.findall(r"\brollout_[a-z0-9_]+\b", target["expr"])}
        assert queried, f"panel {panel['title']!r} queries no rollout series"
        assert queried <= served, f"panel {panel['title']!r} queries {sorted(queried - served)}, not served"
    titles = " ".join(p["title"] for p in dashboard["panels"])
    assert "staleness" in titles and "trainer weight version" in titles and "lost" in titles
