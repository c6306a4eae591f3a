"""The rollout.metrics records of windows and batches, and the ``rollout/`` prefix every metric name carries.

Why: the stream stage (windows) and the shard writer (batches) write these, and the tail view, the exporter
and the report read them; they meet here, byte for byte. The flow records and the flow metric names are
``flow_metrics``'s. Pure: builds and parses bytes, talks to no broker.

Contract: rollout.metrics holds compact JSON, ``window_metrics_record`` / ``batch_metrics_record`` (and
``flow_metrics.flow_metrics_record``), metric names under ``METRIC_PREFIX`` (``prefixed``);
``fold_window_records`` merges a window's per-partition partials back into one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.wire.compact_json import compact_json

METRIC_PREFIX = "rollout/"


def prefixed(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metric names as loggers publish them: everything under ``rollout/``."""
    return {f"{METRIC_PREFIX}{k}": v for k, v in sorted(metrics.items())}


def window_metrics_record(window_start_ms: int, window_end_ms: int, adapter: str | None,
                          metrics: dict[str, Any], *, episodes: int, closed: bool, partition: int | None = None,
                          offset: int | None = None, stats: str | None = None) -> bytes:
    """A window's metrics; the stream stage adds the source ``partition`` it covers, the highest
    final-turn ``offset`` absorbed, and the ``EpisodeStats`` JSON (``stats``) so readers can merge
    the per-partition partials of one window exactly."""
    doc = {"kind": "window", "window": {"start_ms": window_start_ms, "end_ms": window_end_ms},
           "adapter": adapter, "episodes": episodes, "closed": closed, "metrics": prefixed(metrics)}
    extra = {"partition": partition, "offset": offset, "stats": stats}
    doc.update({k: v for k, v in extra.items() if v is not None})
    return compact_json(doc)


@dataclass(frozen=True)
class WindowFold:
    """One window of one adapter, folded from its per-source-partition partials (``fold_window_records``)."""

    start_ms: int
    end_ms: int
    adapter: str | None
    partials: dict[int | None, Mapping[str, Any]]  # the last record of each source partition, in merge order
    latest: Mapping[str, Any]  # the partial that arrived last
    stats: EpisodeStats | None  # the partials' merged stats; None when none carries readable ones
    unmerged: int  # partials left out of ``stats``: without stats, or (``strict=False``) unreadable ones

    @property
    def closed(self) -> bool:
        """A window is closed once every source partition has closed it."""
        return all(bool(doc.get("closed")) for doc in self.partials.values())


def fold_window_records(records: Iterable[bytes | str | Mapping[str, Any]], *, order: str = "partition",
                        strict: bool = True) -> dict[tuple[int, int, str | None], WindowFold]:
    """rollout.metrics window records (values or parsed, in topic order) folded per ``(start_ms, end_ms,
    adapter)``, in the order each first appears; other records, and windows that cannot be read, are skipped.

    Each ``window_metrics_record`` of the stream stage is the full state of one ``(window, adapter, source
    partition)`` partial, so the last record of each partial replaces the earlier ones, and the partials'
    ``stats`` merge exactly (``EpisodeStats.merge``; averaging their ``metrics`` would be wrong).
    ``order``: partials merge by source partition (``"partition"``, one naming none first) or in the
    order each partition first appeared (``"arrival"``); it matters only where partials disagree on
    the reward source (the first episode picks it). ``strict``: unreadable ``stats`` raise
    ``ContractError``, else (False) their partial is left out of ``stats`` and counted in ``unmerged``.
    """
    if order not in ("partition", "arrival"):
        raise ContractError(must_be("order", "'partition' or 'arrival'", order))
    found: dict[tuple[int, int, str | None], dict[int | None, Mapping[str, Any]]] = {}
    latest: dict[tuple[int, int, str | None], Mapping[str, Any]] = {}
    for record in records:
        doc = json.loads(record) if isinstance(record, (bytes, bytearray, str)) else record
        if not isinstance(doc, Mapping) or doc.get("kind") != "window":
            continue
        try:
            wid = (int(doc["window"]["start_ms"]), int(doc["window"]["end_ms"]), doc.get("adapter"))
        except (KeyError, TypeError, ValueError):
            continue
        partition = doc.get("partition")
        found.setdefault(wid, {})[int(partition) if partition is not None else None] = doc
        latest[wid] = doc
    folds = {}
    for wid, partials in found.items():
        if order == "partition":
            partials = dict(sorted(partials.items(), key=lambda item: (item[0] is not None, item[0] or 0)))
        merged, unmerged = None, 0
        for doc in partials.values():
            try:
                stats = EpisodeStats.from_json(doc["stats"]) if "stats" in doc else None
            except ContractError:
                if strict:
                    raise
                stats = None
            if stats is None:
                unmerged += 1
            else:
                merged = stats if merged is None else merged.merge(stats)
        folds[wid] = WindowFold(*wid, partials, latest[wid], merged, unmerged)
    return folds


def batch_metrics_record(batch_seq: int, metrics: dict[str, Any], *, samples: int, manifest_path: str) -> bytes:
    doc = {"kind": "batch", "batch": batch_seq, "samples": samples, "manifest": manifest_path,
           "metrics": prefixed(metrics)}
    return compact_json(doc)
