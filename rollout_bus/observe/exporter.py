"""Prometheus exposition of a run: the latest window and batch metrics, record counters, consumer lag.

Contract (the series compose/README.md and the Grafana dashboard read):

* ``rollout_<path>{adapter, kind}`` gauges: every ``rollout/*`` metric of the latest window of each
  adapter (``kind="window"``) and of the latest batch (``kind="batch"``), named by
  ``metric_series`` (``rollout/adapter/math/episode_response_length/mean`` ->
  ``rollout_episode_response_length_mean{adapter="math"}``; unscoped keys get the record's adapter,
  ``""`` when none). A key scoped to an adapter wins over an unscoped key that names the same series.
  The latest batch's staleness arrives this way: ``rollout_staleness_{mean,max,oldest}{adapter,
  kind="batch"}`` (``metrics.compute_staleness_metrics``, step = the batch seq).
* ``rollout_run_max_staleness``: the run's staleness bound as declared on rollout.run (absent without one).
* ``rollout_window_episodes{adapter}`` (latest window), ``rollout_latest_batch`` (its sequence),
  ``rollout_trainer_weight_version`` (the trainer's live version on rollout.weights; absent while
  there is none: no topic, or nothing published).
* Counters ``rollout_episodes_total{adapter}``, ``rollout_batches_total``,
  ``rollout_batch_samples_total``, ``rollout_dlq_records_total{stage, reason}`` (reason: the
  dead letter's kind), and the gauge ``rollout_consumer_lag{group, topic, partition}``.
* Flow (``metrics_view.MetricsView.flow``): per generator or trainer (label ``source``) the gauges
  ``rollout_flow_generator_gate_blocked_fraction`` and ``rollout_flow_trainer_wait_fraction`` and the counters
  ``rollout_flow_generator_gate_blocked_seconds_total``, ``rollout_flow_generator_gate_waits_total``,
  ``rollout_flow_trainer_wait_seconds_total``, ``rollout_flow_trainer_steps_total`` (a restarted source starts
  again from 0: a counter reset); the latest batch's ``rollout_flow_sample_age_s_{p50,p99,max}`` and
  ``rollout_flow_discarded_token_fraction*`` gauges (``kind="batch"``, as every batch metric); and over every
  batch ``rollout_flow_discarded_tokens_total{cause}`` and ``rollout_flow_response_tokens_total``.
* Counters are restart-safe by recomputation: the exporter reads rollout.metrics and rollout.dlq
  from the beginning and serves nothing until it has caught up with the end offsets it found at
  start, so a restarted exporter reports the same totals (Prometheus sees no reset). Batches count
  distinct batch sequences and episodes count the windows' final partials, so records published
  twice are not counted twice. A topic's retention deleting old records lowers a total, which
  Prometheus reads as a counter reset.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rollout_bus.kafka.clients import KafkaError
from rollout_bus.observe.metrics_view import metric_series
from rollout_bus.observe.live_feed import MetricsFeed
from rollout_bus.wire.flow_metrics import DISCARDED_TOKENS, RESPONSE_TOKENS
from rollout_bus.wire.metrics_records import METRIC_PREFIX

logger = logging.getLogger(__name__)


def _label(adapter: str | None) -> str:
    return adapter if adapter is not None else ""


def metric_gauges(snapshot: dict[str, Any]) -> list[Metric]:
    """One gauge family per metric name, over the latest windows and the latest batch."""
    values: dict[str, dict[tuple[str, str], tuple[bool, float]]] = {}
    sources = [("window", w["adapter"], w["metrics"]) for w in snapshot["windows"]]
    if snapshot["batch"] is not None:
        sources.append(("batch", None, snapshot["batch"]["metrics"]))
    for kind, adapter, metrics in sources:
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, series_adapter = metric_series(key, adapter)
            scoped = key.removeprefix(METRIC_PREFIX).startswith("adapter/")
            labels = (_label(series_adapter), kind)
            current = values.setdefault(name, {}).get(labels)
            if current is None or (scoped and not current[0]):
                values[name][labels] = (scoped, float(value))
    families = []
    for name in sorted(values):
        family = GaugeMetricFamily(name, f"latest {name[len('rollout_'):]} (rollout.metrics)",
                                   labels=["adapter", "kind"])
        for labels, (_, value) in sorted(values[name].items()):
            family.add_metric(list(labels), value)
        families.append(family)
    return families


def snapshot_families(snapshot: dict[str, Any]) -> list[Metric]:
    """Every series the exporter serves, from one ``MetricsView`` snapshot."""
    families = metric_gauges(snapshot)
    window_episodes = GaugeMetricFamily("rollout_window_episodes", "episodes in the latest window",
                                        labels=["adapter"])
    for window in snapshot["windows"]:
        window_episodes.add_metric([_label(window["adapter"])], window["episodes"])
    episodes = CounterMetricFamily("rollout_episodes", "finished episodes counted in windows", labels=["adapter"])
    for row in snapshot["episodes"]:
        episodes.add_metric([_label(row["adapter"])], row["episodes"])
    batches = CounterMetricFamily("rollout_batches", "distinct batches announced", value=snapshot["batches"])
    samples = CounterMetricFamily("rollout_batch_samples", "samples in announced batches",
                                  value=snapshot["batch_samples"])
    dlq = CounterMetricFamily("rollout_dlq_records", "dead letters by stage and reason kind",
                              labels=["stage", "reason"])
    for row in snapshot["dlq"]["by_reason"]:
        dlq.add_metric([row["stage"], row["kind"]], row["count"])
    lag = GaugeMetricFamily("rollout_consumer_lag", "end offset minus committed offset",
                            labels=["group", "topic", "partition"])
    lost = GaugeMetricFamily("rollout_consumer_lost_records", "records deleted (retention, DeleteRecords) between "
                             "the group's committed offset and the log start, never read", labels=["group", "topic",
                                                                                                   "partition"])
    for row in snapshot["lag"]:
        lag.add_metric([row["group"], row["topic"], str(row["partition"])], row["lag"])
        lost.add_metric([row["group"], row["topic"], str(row["partition"])], row.get("lost", 0))
    families += [window_episodes, episodes, batches, samples, dlq, lag, lost, *flow_families(snapshot.get("flow"))]
    if snapshot["batch"] is not None:
        families.append(GaugeMetricFamily("rollout_latest_batch", "sequence of the latest batch",
                                          value=snapshot["batch"]["batch"]))
    bound = (snapshot.get("run") or {}).get("max_staleness")
    if bound is not None:  # the run's staleness bound, as declared on rollout.run (alerts compare with it)
        families.append(GaugeMetricFamily("rollout_run_max_staleness", "the run's staleness bound (rollout.run)",
                                          value=bound))
    version = (snapshot.get("trainer") or {}).get("weight_version")
    if version is not None:
        families.append(GaugeMetricFamily("rollout_trainer_weight_version",
                                          "the trainer's live weight version (rollout.weights)", value=version))
    return families


def _flow_name(key: str) -> str:
    """``rollout/flow/trainer/wait_s`` -> ``rollout_flow_trainer_wait_seconds`` (seconds said in full)."""
    name, _ = metric_series(key)
    return name[:-2] + "_seconds" if name.endswith("_s") else name


def flow_families(flow: dict[str, Any] | None) -> list[Metric]:
    """The generators' and the trainer's flow by source (fractions as gauges, totals as counters), and the
    batches' discarded and response tokens summed (counters)."""
    if not flow:
        return []
    gauges: dict[str, GaugeMetricFamily] = {}
    counters: dict[str, CounterMetricFamily] = {}
    for row in flow["sources"]:
        for key, value in sorted(row["metrics"].items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = _flow_name(key)
            if name.endswith("_fraction"):
                family = gauges.setdefault(name, GaugeMetricFamily(
                    name, f"{row['stage']} flow: {key} (rollout.metrics)", labels=["source"]))
            else:
                family = counters.setdefault(name, CounterMetricFamily(
                    name, f"{row['stage']} flow: {key} since it started (rollout.metrics)", labels=["source"]))
            family.add_metric([row["source"]], float(value))
    tokens = CounterMetricFamily("rollout_flow_discarded_tokens", "response tokens that never train, by cause, "
                                 "summed over the batches", labels=["cause"])
    totals = flow["batch_totals"]
    for key, value in totals.items():
        if key.startswith(METRIC_PREFIX + DISCARDED_TOKENS):
            tokens.add_metric([key.rsplit("/", 1)[1]], value)
    families: list[Metric] = [*gauges.values(), *counters.values(), tokens]
    response = totals.get(METRIC_PREFIX + RESPONSE_TOKENS)
    if response is not None:
        families.append(CounterMetricFamily("rollout_flow_response_tokens", "response tokens of every episode the "
                                            "batches decided on (written and stale, and those takeovers threw away)",
                                            value=response))
    return families


class SnapshotCollector:
    """A prometheus_client collector serving the last snapshot handed to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: list[Metric] = []

    def update(self, snapshot: dict[str, Any]) -> None:
        families = snapshot_families(snapshot)
        with self._lock:
            self._families = families

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from list(self._families)


class Exporter:
    """Catches up with the topics, then serves /metrics and refreshes every ``interval_s``."""

    def __init__(self, feed: MetricsFeed, *, interval_s: float = 5.0) -> None:
        self.feed, self.interval_s = feed, interval_s
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.stopped = threading.Event()
        self.refreshes = 0

    def refresh(self) -> dict[str, Any]:
        self.feed.refresh()
        snapshot = self.feed.snapshot()
        self.collector.update(snapshot)
        self.refreshes += 1
        return snapshot

    def serve(self, bind: str, port: int, *, catch_up_timeout_s: float = 300.0, on_ready=None) -> None:
        """Blocks until ``stopped`` is set; ``on_ready(url)`` once the first full snapshot is served."""
        read = self.feed.catch_up(catch_up_timeout_s)
        self.refresh()
        server, thread = start_http_server(port, addr=bind, registry=self.registry)
        url = f"http://{bind}:{server.server_port}/metrics"
        logger.info("exporter serving url=%s records_read=%d", url, read)
        if on_ready is not None:
            on_ready(url)
        try:
            while not self.stopped.wait(self.interval_s):
                try:
                    self.refresh()
                except KafkaError as exc:  # keep serving the last snapshot while the cluster is away
                    logger.warning("exporter refresh failed, serving the last snapshot: %s", exc)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
