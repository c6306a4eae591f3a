"""The run report: what a run did, folded from its topics and manifests into what its page shows (``Report``).

Contract:

* ``fold_windows(docs)`` turns rollout.metrics window records (parsed JSON, topic order) into one
  ``WindowPoint`` per ``(window, adapter)``: ``metrics_records.fold_window_records`` (the last record of each
  source partition's partial, their ``EpisodeStats`` merged in the order the partitions first
  appeared; unreadable ``stats`` raise ``ContractError``). A record without ``stats`` is shown from
  its own metrics when it is the window's only partial, and is otherwise left out (logged): metrics
  alone cannot be merged exactly.
* ``fold_batches(announcements, manifests, batch_docs)`` gives one ``BatchRow`` per batch seq from
  the rollout.shards announcements and the manifests on disk (the same document; disk wins), and
  from rollout.metrics batch records for a batch neither holds (samples and staleness only). A
  row's ``staleness`` is ``metrics_view.staleness_rows`` of its metrics (mean / max / oldest per
  scope), shown in the batch table; empty when the batch has no staleness metrics.
* ``Report.flow`` is ``flow_fold.fold_flow`` of the run's rollout.metrics records (``Flow``): each batch's
  flow metrics by seq, and the latest flow record of each (stage, source).
* ``fold_dead_letters(letters)`` counts dead letters by ``(stage, kind)`` with a few
  example reasons (of distinct patterns: numbers and bracketed keys blanked) and sources,
  largest count first.
* ``build_report(run, ...)`` applies the adapter filter (windows of other adapters are dropped;
  batches are kept when they hold a chosen adapter, their samples chart shows only the chosen
  ones; dead letters whose key names another adapter are dropped, those naming none are kept).
* ``report_html.render_html(report)`` renders it as one HTML page.
* Pure: no Kafka, no files. ``rollout_bus.cli.report`` reads the topics (``RawRun``) and the
  manifests, and writes the page.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.observe.learning import LearningCurve
from rollout_bus.observe.flow_fold import Flow, fold_flow
from rollout_bus.observe.metrics_view import staleness_rows
from rollout_bus.wire.metrics_records import METRIC_PREFIX, WindowFold, fold_window_records
from rollout_bus.wire.rollout_key import rollout_key_adapter
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

NAN = float("nan")
_LENGTH_KEYS = ("mean", "median", "min", "max")


@dataclass(frozen=True)
class WindowPoint:
    """One window's episode metrics for one adapter (None: adapter-less episodes)."""

    start_ms: int
    end_ms: int
    adapter: str | None
    episodes: int
    closed: bool
    mean: float
    median: float
    low: float
    high: float
    total_mean: float
    reward: float


@dataclass(frozen=True)
class BatchRow:
    """One written batch, as its manifest (or batch metrics record) describes it."""

    seq: int
    samples: int
    response_tokens: int | None
    tokens: int | None
    dp_size: int | None
    partial: bool | None
    groups: int | None
    episodes: int | None
    samples_by_adapter: Mapping[str | None, int]
    origin: str  # "disk", "topic" or "metrics"
    staleness: tuple[dict[str, Any], ...] = ()  # metrics_view.staleness_rows of the batch's metrics


@dataclass(frozen=True)
class DlqGroup:
    """Dead letters of one stage and kind."""

    stage: str
    kind: str
    count: int
    examples: tuple[str, ...]
    sources: tuple[str, ...]


@dataclass
class RawRun:
    """What was read from the run's topics: parsed records and counts, nothing folded yet."""

    metrics: list[dict] = field(default_factory=list)
    announcements: list[dict] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    first_ms: int | None = None
    last_ms: int | None = None


@dataclass(frozen=True)
class Report:
    """Everything the page shows."""

    title: str
    topics: Topics
    windows: list[WindowPoint]
    batches: list[BatchRow]
    dlq: list[DlqGroup]
    counts: Mapping[str, int]
    first_ms: int | None
    last_ms: int | None
    adapters: tuple[str | None, ...]
    adapter_filter: tuple[str, ...] = ()
    shards_dir: str | None = None
    color_order: tuple[str | None, ...] = ()  # every adapter of the run, so a filter keeps the colours
    learning: LearningCurve | None = None  # with a trainer's trained.jsonl: the reward curve
    flow: Flow = field(default_factory=Flow)

    @property
    def episodes(self) -> int:
        return sum(w.episodes for w in self.windows)

    @property
    def dlq_total(self) -> int:
        return sum(g.count for g in self.dlq)


def _metric(metrics: Mapping[str, Any], adapter: str | None, name: str) -> float:
    """A metric of ``adapter``'s scope, published (``rollout/``-prefixed) or as EpisodeStats gives it."""
    scoped = f"adapter/{adapter}/{name}" if adapter is not None else name
    value = metrics.get(f"{METRIC_PREFIX}{scoped}", metrics.get(scoped))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else NAN


def _point(window: tuple[int, int], adapter: str | None, episodes: int, closed: bool,
           metrics: Mapping[str, Any]) -> WindowPoint:
    length = [_metric(metrics, adapter, f"episode_response_length/{k}") for k in _LENGTH_KEYS]
    return WindowPoint(window[0], window[1], adapter, episodes, closed, *length,
                       _metric(metrics, adapter, "episode_total_response_length/mean"),
                       _metric(metrics, adapter, "episode_raw_reward"))


def _window_point(fold: WindowFold) -> WindowPoint:
    """One window of one adapter from its folded partials (see the module contract)."""
    window, adapter = (fold.start_ms, fold.end_ms), fold.adapter
    if fold.unmerged:
        if len(fold.partials) == 1:
            return _point(window, adapter, int(fold.latest.get("episodes", 0)), fold.closed,
                          fold.latest.get("metrics", {}))
        logger.warning("window=%d-%d adapter=%s: %d partials without stats left out", *window, adapter,
                       fold.unmerged)
    merged = fold.stats if fold.stats is not None else EpisodeStats()
    return _point(window, adapter, merged.episodes, fold.closed, merged.metrics())


def fold_windows(docs: Iterable[Mapping[str, Any]]) -> list[WindowPoint]:
    """Window records in topic order -> one point per (window, adapter), by window then adapter."""
    folds = fold_window_records((doc for doc in docs if isinstance(doc, Mapping)), order="arrival")
    order = sorted(folds, key=lambda k: (k[0], k[2] is not None, k[2] or ""))
    return [_window_point(folds[k]) for k in order]


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def batch_row(manifest: Mapping[str, Any], origin: str) -> BatchRow:
    """A batch from its manifest: sizes, and its samples (segments) per adapter from the episode list."""
    extra = manifest.get("extra") if isinstance(manifest.get("extra"), Mapping) else {}
    episodes = extra.get("episodes") if isinstance(extra.get("episodes"), list) else None
    samples = int(manifest.get("num_samples", 0))
    by_adapter: dict[str | None, int] = defaultdict(int)
    for episode in episodes or []:
        by_adapter[rollout_key_adapter(episode.get("key"))] += int(episode.get("segments", 1))
    if sum(by_adapter.values()) != samples:  # no (or an inconsistent) episode list: one unattributed part
        by_adapter = {None: samples}
    groups = extra.get("groups")
    return BatchRow(int(manifest["seq"]), samples, _int_or_none(manifest.get("num_response_tokens")),
                    _int_or_none(manifest.get("num_tokens")), _int_or_none(manifest.get("dp_size")),
                    extra.get("partial") if isinstance(extra.get("partial"), bool) else None,
                    len(groups) if isinstance(groups, list) else None, len(episodes) if episodes is not None else None,
                    dict(by_adapter), origin, _staleness(manifest.get("metrics")))


def _staleness(metrics: Any) -> tuple[dict[str, Any], ...]:
    return tuple(staleness_rows(metrics)) if isinstance(metrics, Mapping) else ()


def fold_batches(announcements: Iterable[Mapping[str, Any]], manifests: Iterable[Mapping[str, Any]] = (),
                 batch_docs: Iterable[Mapping[str, Any]] = ()) -> list[BatchRow]:
    """One row per batch seq, in seq order (see the module contract for which source wins)."""
    rows: dict[int, BatchRow] = {}
    for doc in batch_docs:
        if isinstance(doc, Mapping) and doc.get("kind") == "batch" and _int_or_none(doc.get("batch")) is not None:
            rows[int(doc["batch"])] = BatchRow(int(doc["batch"]), int(doc.get("samples", 0)), None, None, None, None,
                                               None, None, {None: int(doc.get("samples", 0))}, "metrics",
                                               _staleness(doc.get("metrics")))
    for origin, docs in (("topic", announcements), ("disk", manifests)):
        for manifest in docs:
            if isinstance(manifest, Mapping) and _int_or_none(manifest.get("seq")) is not None:
                rows[int(manifest["seq"])] = batch_row(manifest, origin)
    return [rows[seq] for seq in sorted(rows)]


def _reason_pattern(reason: str) -> str:
    """A reason with its particulars (numbers, bracketed keys) blanked: examples should differ in kind."""
    return re.sub(r"\[[^\]]*\]|\d+", "#", reason)


def fold_dead_letters(letters: Iterable[DeadLetter], examples: int = 3) -> list[DlqGroup]:
    """Counts by (stage, kind), each with up to ``examples`` reasons of distinct patterns, and sources."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    reasons: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    sources: dict[tuple[str, str], list[str]] = defaultdict(list)
    for letter in letters:
        key = (letter.stage or "?", letter.kind or "?")
        counts[key] += 1
        pattern = _reason_pattern(letter.reason)
        if pattern not in reasons[key] and len(reasons[key]) < examples:
            reasons[key][pattern] = letter.reason
        if letter.source and len(sources[key]) < examples:
            sources[key].append(letter.source)
    order = sorted(counts, key=lambda k: (-counts[k], k))
    return [DlqGroup(k[0], k[1], counts[k], tuple(reasons[k].values()), tuple(sources[k])) for k in order]


def _keep_batch(row: BatchRow, chosen: set[str]) -> BatchRow | None:
    kept = {a: n for a, n in row.samples_by_adapter.items() if a in chosen}
    if not kept and None not in row.samples_by_adapter:
        return None
    staleness = tuple(r for r in row.staleness if r["adapter"] is None or r["adapter"] in chosen)
    return BatchRow(**{**row.__dict__, "samples_by_adapter": kept or dict(row.samples_by_adapter),
                       "staleness": staleness})


def _adapters_of(windows: list[WindowPoint], batches: list[BatchRow]) -> tuple[str | None, ...]:
    seen = {w.adapter for w in windows} | {a for b in batches for a in b.samples_by_adapter}
    return tuple(sorted(seen, key=lambda a: (a is not None, a or "")))


def build_report(run: RawRun, topics: Topics, *, title: str | None = None, adapters: Sequence[str] = (),
                 manifests: Iterable[Mapping[str, Any]] = (), shards_dir: str | None = None,
                 learning: LearningCurve | None = None) -> Report:
    """Fold a read run into the report, keeping only ``adapters`` when given."""
    chosen = {a for a in adapters if a}
    windows = fold_windows(run.metrics)
    batches = fold_batches(run.announcements, manifests, run.metrics)
    letters = list(run.dead_letters)
    every = _adapters_of(windows, batches)
    if chosen:
        windows = [w for w in windows if w.adapter in chosen]
        batches = [row for row in (_keep_batch(b, chosen) for b in batches) if row is not None]
        letters = [d for d in letters if rollout_key_adapter(d.key) in chosen or rollout_key_adapter(d.key) is None]
    run_name = topics.prefix.rstrip(".") or "(no topic prefix)"
    return Report(title or f"rollout-bus run {run_name}", topics, windows, batches, fold_dead_letters(letters),
                  dict(run.counts), run.first_ms, run.last_ms, _adapters_of(windows, batches), tuple(sorted(chosen)),
                  shards_dir, every, learning, fold_flow(run.metrics))

