"""The operator's view of a run: a pure fold of rollout.metrics and rollout.dlq records into a snapshot.

Contract:

* ``MetricsView.add_metrics(value)`` takes rollout.metrics values in topic order. Window records
  (``metrics_records.window_metrics_record``) arrive as per ``(window, adapter, source partition)`` partials;
  a window's view is ``metrics_records.fold_window_records`` of them (the last record of each partial, their
  ``EpisodeStats`` merged in partition order; unreadable ``stats`` are left out). When no partial
  carries readable ``stats`` the window is taken as given: the latest partial's metrics, the
  partials' episodes summed. Batch records are kept by batch sequence (a re-announced batch counts
  once); the latest batch is the highest sequence.
* ``MetricsView.add_dead_letter(letter)`` counts dead letters by ``(stage, kind)``.
* ``adapter`` filters the view: only that adapter's windows and episodes, the batch metrics scoped
  to it (``rollout/adapter/{name}/...``), and the dead letters whose record key is a rollout key of
  that adapter.
* ``snapshot(...)`` is plain JSON-ready data: what ``rollout-bus tail --once --json`` prints and what
  the exporter turns into Prometheus series. Unreadable records are counted (``skipped``), never fatal.
  ``staleness`` is ``staleness_rows`` of the latest batch's metrics; ``trainer`` is the
  ``weight_version.WeightVersion`` handed in as ``weights`` (``weight_version``, ``step``,
  ``published_at``), all None when there is none (no rollout.weights, or nothing published). ``flow``
  is ``flow()``: ``sources``, the latest flow record (``flow_metrics.flow_metrics_record``) of each (stage,
  source) as ``{"stage", "source", "elapsed_s", "final", "metrics"}``, and ``batch_totals``, every batch's
  ``rollout/flow/discarded_tokens/*`` and ``rollout/flow/response_tokens`` summed over distinct batches.
* ``staleness_rows(metrics)``: one row per scope holding ``staleness/*`` keys
  (``metrics.compute_staleness_metrics``), ``{"adapter", "mean", "max", "oldest"}`` (None where a
  key is missing), the unscoped row first, then adapters by name.
* ``metric_series(name, adapter)`` is the Prometheus naming rule: ``rollout/adapter/math/x/mean``
  becomes ``("rollout_x_mean", "math")``; an unscoped key keeps the record's adapter.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Any

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.errors import ContractError
from rollout_bus.wire.flow_metrics import DISCARDED_TOKENS, INCOMPLETE_GROUPS, RESPONSE_TOKENS
from rollout_bus.wire.metrics_records import METRIC_PREFIX, fold_window_records, prefixed
from rollout_bus.wire.weight_version import WeightVersion
from rollout_bus.wire.rollout_key import rollout_key_adapter

logger = logging.getLogger(__name__)

Window = tuple[int, int]
WindowId = tuple[int, int, str | None]  # start_ms, end_ms, adapter
_ADAPTER_SCOPE = "adapter/"
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
_STALENESS = "staleness/"
FLOW_TOTALS = (METRIC_PREFIX + DISCARDED_TOKENS, METRIC_PREFIX + RESPONSE_TOKENS,  # summed over batches
               METRIC_PREFIX + INCOMPLETE_GROUPS)
STALENESS_STATS = ("mean", "max", "oldest")


def metric_series(name: str, adapter: str | None = None) -> tuple[str, str | None]:
    """Prometheus metric name and adapter label of a published metric name."""
    path = name[len(METRIC_PREFIX):] if name.startswith(METRIC_PREFIX) else name
    if path.startswith(_ADAPTER_SCOPE) and path.count("/") >= 2:
        scoped, path = path[len(_ADAPTER_SCOPE):].split("/", 1)
        adapter = scoped
    return "rollout_" + _INVALID.sub("_", path.replace("/", "_")), adapter


def staleness_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``staleness/{mean,max,oldest}`` of each scope in a batch's metrics (see the module docstring)."""
    rows: dict[str | None, dict[str, Any]] = {}
    for name, value in metrics.items():
        path = name[len(METRIC_PREFIX):] if name.startswith(METRIC_PREFIX) else name
        adapter = None
        if path.startswith(_ADAPTER_SCOPE) and path.count("/") >= 2:
            adapter, path = path[len(_ADAPTER_SCOPE):].split("/", 1)
        stat = path[len(_STALENESS):] if path.startswith(_STALENESS) else None
        if stat in STALENESS_STATS:
            rows.setdefault(adapter, {"adapter": adapter, **dict.fromkeys(STALENESS_STATS)})[stat] = value
    return [rows[a] for a in sorted(rows, key=lambda a: (a is not None, a or ""))]


class MetricsView:
    """Folds metrics and dead-letter records into the latest windows, batches and DLQ counts."""

    def __init__(self, adapter: str | None = None, *, keep_windows: int = 4) -> None:
        self.adapter = adapter
        self.keep_windows = keep_windows
        # per window, the last record of each source partition's partial, the latest arrival last
        self._windows: dict[WindowId, dict[int | None, dict[str, Any]]] = {}
        self._episodes: dict[tuple[WindowId, int | None], int] = {}  # kept after a window is pruned
        self._batches: dict[int, dict[str, Any]] = {}
        self._flow: dict[tuple[str, str], dict[str, Any]] = {}  # the latest flow record of each (stage, source)
        self._dlq: Counter[tuple[str, str]] = Counter()
        self.skipped = 0

    def add_metrics(self, value: bytes | str | None) -> None:
        """One rollout.metrics record value; unreadable ones are counted in ``skipped``."""
        try:
            doc = json.loads(value) if value is not None else None
            if not isinstance(doc, dict):
                raise ContractError(f"a metrics record must be a JSON object (got {type(doc).__name__})")
            if doc.get("kind") == "window":
                self._add_window(doc)
            elif doc.get("kind") == "batch":
                self._add_batch(doc)
            elif doc.get("kind") == "flow":
                self._add_flow(doc)
            else:
                raise ContractError(f"unknown metrics record kind {doc.get('kind')!r}")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            self.skipped += 1
            logger.debug("skipped metrics record: %s", exc)

    def _add_window(self, doc: dict[str, Any]) -> None:
        adapter = doc["adapter"]
        if self.adapter is not None and adapter != self.adapter:
            return
        wid = (int(doc["window"]["start_ms"]), int(doc["window"]["end_ms"]), adapter)
        partition = int(doc["partition"]) if doc.get("partition") is not None else None
        partial = {**doc, "episodes": int(doc["episodes"]), "closed": bool(doc["closed"]),
                   "metrics": dict(doc["metrics"])}
        partials = self._windows.setdefault(wid, {})
        partials.pop(partition, None)  # the latest arrival last
        partials[partition] = partial
        self._episodes[(wid, partition)] = partial["episodes"]
        self._prune(adapter)

    def _prune(self, adapter: str | None) -> None:
        """Keep the partials of the newest ``keep_windows`` windows of an adapter (counts stay)."""
        mine = sorted(wid for wid in self._windows if wid[2] == adapter)
        for wid in mine[:-self.keep_windows]:
            del self._windows[wid]

    def _add_batch(self, doc: dict[str, Any]) -> None:
        seq = int(doc["batch"])
        metrics = dict(doc["metrics"])
        if self.adapter is not None:
            scope = f"{METRIC_PREFIX}{_ADAPTER_SCOPE}{self.adapter}/"
            metrics = {k: v for k, v in metrics.items() if k.startswith(scope)}
        self._batches[seq] = {"batch": seq, "samples": int(doc["samples"]), "manifest": doc.get("manifest"),
                              "metrics": metrics}

    def _add_flow(self, doc: dict[str, Any]) -> None:
        stage, source = str(doc["stage"]), str(doc["source"])
        self._flow[(stage, source)] = {"stage": stage, "source": source, "elapsed_s": float(doc["elapsed_s"]),
                                       "final": bool(doc.get("final")), "metrics": dict(doc["metrics"])}

    def flow(self) -> dict[str, Any]:
        """The latest flow record of each (stage, source), in that order, and the batch flow summed over batches."""
        totals: Counter[str] = Counter()
        for batch in self._batches.values():
            for key, value in batch["metrics"].items():
                if key.startswith(FLOW_TOTALS) and isinstance(value, (int, float)) and not isinstance(value, bool):
                    totals[key] += value
        return {"sources": [self._flow[k] for k in sorted(self._flow)],
                "batch_totals": {k: float(v) for k, v in sorted(totals.items())}}

    def add_dead_letter(self, letter: DeadLetter) -> None:
        if self.adapter is not None and rollout_key_adapter(letter.key) != self.adapter:
            return
        self._dlq[(letter.stage, letter.kind)] += 1

    def latest_windows(self) -> list[dict[str, Any]]:
        """The newest window of each adapter, its partials merged."""
        newest: dict[str | None, WindowId] = {}
        for wid in self._windows:
            if wid[2] not in newest or wid[:2] > newest[wid[2]][:2]:
                newest[wid[2]] = wid
        order = sorted(newest.values(), key=lambda wid: (wid[2] is not None, wid[2] or ""))
        return [self._window_view(wid) for wid in order]

    def _window_view(self, wid: WindowId) -> dict[str, Any]:
        (fold,) = fold_window_records(self._windows[wid].values(), order="partition", strict=False).values()
        if fold.unmerged:
            logger.debug("window=%d-%d adapter=%s: %d partials without readable stats", *wid, fold.unmerged)
        if fold.stats is not None:
            metrics, episodes = prefixed(fold.stats.metrics()), fold.stats.episodes
        else:
            metrics, episodes = fold.latest["metrics"], sum(p["episodes"] for p in fold.partials.values())
        return {"window": {"start_ms": wid[0], "end_ms": wid[1]}, "adapter": wid[2], "episodes": episodes,
                "closed": fold.closed, "partitions": sorted(p for p in fold.partials if p is not None),
                "metrics": metrics}

    def episodes_by_adapter(self) -> list[dict[str, Any]]:
        totals: Counter[str | None] = Counter()
        for (wid, _partition), episodes in self._episodes.items():
            totals[wid[2]] += episodes
        return [{"adapter": a, "episodes": n} for a, n in sorted(totals.items(), key=lambda i: (i[0] is not None,
                                                                                               i[0] or ""))]

    def snapshot(self, *, lag: list[dict[str, Any]] | None = None, dlq_records: int | None = None,
                 topics: dict[str, str] | None = None, weights: WeightVersion | None = None) -> dict[str, Any]:
        """Everything an operator looks at, as JSON-ready data."""
        latest = self._batches[max(self._batches)] if self._batches else None
        dlq = [{"stage": stage, "kind": kind, "count": count} for (stage, kind), count in sorted(self._dlq.items())]
        return {
            "adapter": self.adapter,
            "topics": dict(topics or {}),
            "windows": self.latest_windows(),
            "episodes": self.episodes_by_adapter(),
            "batch": latest,
            "batches": len(self._batches),
            "batch_samples": sum(b["samples"] for b in self._batches.values()),
            "staleness": staleness_rows(latest["metrics"]) if latest is not None else [],
            "trainer": {"weight_version": weights.version if weights is not None else None,
                        "step": weights.step if weights is not None else None,
                        "published_at": weights.published_at if weights is not None else None},
            "dlq": {"counted": sum(self._dlq.values()), "on_topic": dlq_records, "by_reason": dlq},  # on_topic: unfiltered
            "lag": list(lag or []),
            "flow": self.flow(),
            "skipped": self.skipped,
        }

