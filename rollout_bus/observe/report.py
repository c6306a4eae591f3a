"""The run report: what a run did, folded from its topics and manifests into one self-contained HTML page.

Contract:

* ``fold_windows(docs)`` turns rollout.metrics window records (parsed JSON, topic order) into one
  ``WindowPoint`` per ``(window, adapter)``: ``records.fold_window_records`` (the last record of each
  source partition's partial, their ``EpisodeStats`` merged in the order the partitions first
  appeared; unreadable ``stats`` raise ``ContractError``). A record without ``stats`` is shown from
  its own metrics when it is the window's only partial, and is otherwise left out (logged): metrics
  alone cannot be merged exactly.
* ``fold_batches(announcements, manifests, batch_docs)`` gives one ``BatchRow`` per batch seq from
  the rollout.shards announcements and the manifests on disk (the same document; disk wins), and
  from rollout.metrics batch records for a batch neither holds (samples and staleness only). A
  row's ``staleness`` is ``metrics_view.staleness_rows`` of its metrics (mean / max / oldest per
  scope), shown in the batch table; empty when the batch has no staleness metrics.
* ``fold_flow(docs)`` gives the run's flow (``Flow``): from rollout.metrics batch records, each batch's
  ``rollout/flow/...`` metrics by seq (the manifest holds none), and the latest flow record of each
  (stage, source): the generators' time behind the staleness gate, the trainer's waiting for batches.
* ``fold_dead_letters(letters)`` counts dead letters by ``(stage, kind)`` with a few
  example reasons (of distinct patterns: numbers and bracketed keys blanked) and sources,
  largest count first.
* ``build_report(run, ...)`` applies the adapter filter (windows of other adapters are dropped;
  batches are kept when they hold a chosen adapter, their samples chart shows only the chosen
  ones; dead letters whose key names another adapter are dropped, those naming none are kept).
* ``render_html(report)`` returns one HTML document with no external resources (inline CSS and
  SVG, no scripts); every value from the run is escaped.
* Pure: no Kafka, no files. ``rollout_bus.cli.report`` reads the topics (``RawRun``) and the
  manifests, and writes the page.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from html import escape
from typing import Any, Iterable, Mapping, Sequence

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.observe.learning import LearningCurve, reward_charts
from rollout_bus.observe.metrics_view import staleness_rows
from rollout_bus.wire.records import WindowFold, fold_window_records
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
class Flow:
    """Who waited, and how old and how wasted each batch was (``fold_flow``)."""

    batches: dict[int, dict[str, float]] = field(default_factory=dict)  # seq -> its flow metrics, without rollout/
    sources: list[dict[str, Any]] = field(default_factory=list)  # the latest flow record of each (stage, source)


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
    value = metrics.get(f"rollout/{scoped}", metrics.get(scoped))
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


_FLOW = "rollout/flow/"


def fold_flow(docs: Iterable[Mapping[str, Any]]) -> Flow:
    """The run's flow from its rollout.metrics records, in topic order (see the module contract)."""
    batches: dict[int, dict[str, float]] = {}
    sources: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        if not isinstance(doc, Mapping) or not isinstance(doc.get("metrics"), Mapping):
            continue
        found = {k[len("rollout/"):]: float(v) for k, v in doc["metrics"].items() if k.startswith(_FLOW)
                 and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if doc.get("kind") == "batch" and _int_or_none(doc.get("batch")) is not None and found:
            batches[int(doc["batch"])] = found
        elif doc.get("kind") == "flow" and isinstance(doc.get("stage"), str) and isinstance(doc.get("source"), str):
            sources[(doc["stage"], doc["source"])] = {
                "stage": doc["stage"], "source": doc["source"], "elapsed_s": doc.get("elapsed_s"),
                "final": bool(doc.get("final")), "metrics": found}
    return Flow(dict(sorted(batches.items())), [sources[k] for k in sorted(sources)])


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


# ---------------------------------------------------------------------------- the page

_CSS = """
body{font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;background:#f6f7f9;margin:0}
main{max-width:1040px;margin:0 auto;padding:28px 24px 60px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:36px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin:0 0 18px}.note{color:#666;font-size:13px;margin:4px 0 10px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px}
.card{background:#fff;border:1px solid #e2e4e8;border-radius:8px;padding:10px 14px}
.card .v{font-size:24px;font-weight:600;font-variant-numeric:tabular-nums}.card .k{color:#666;font-size:13px}
.card.bad{border-color:#d55e00;background:#fff6f0}.card.bad .v{color:#b34700}.card.good .v{color:#007a57}
.panel{background:#fff;border:1px solid #e2e4e8;border-radius:8px;padding:8px 10px;margin:10px 0}
table{border-collapse:collapse;width:100%;background:#fff;font-size:13.5px;margin:8px 0}
th,td{text-align:left;padding:5px 9px;border-bottom:1px solid #eceef1;vertical-align:top}
th{background:#f0f2f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
div.reason{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;word-break:break-word}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(440px,1fr));gap:0 10px}
.grid .panel{margin:0 0 10px}.nowrap{white-space:nowrap}
details summary{cursor:pointer;color:#0b5cad;margin:6px 0}
"""


def _when(ms: int | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return time.strftime(fmt, time.gmtime(ms / 1000)) + (" UTC" if "%Y" in fmt else "") if ms else "n/a"


def _num(value: float | int | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:,}" if isinstance(value, int) or value == int(value) else f"{value:,.{digits}f}"


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], numeric: set[int] = frozenset()) -> str:
    """Cells are already-escaped HTML; ``numeric`` columns align right."""
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _colors(report: Report) -> dict[str | None, str]:
    from rollout_bus.observe.charts import color_for

    order = list(report.color_order) + [a for a in report.adapters if a not in report.color_order]
    return {a: color_for(i) for i, a in enumerate(order)}


def _name(adapter: str | None) -> str:
    return adapter if adapter is not None else "(no adapter)"


def _window_charts(report: Report) -> str:
    """Means of every adapter on one chart; each adapter's min-max band on its own (shared scale)."""
    from rollout_bus.observe.charts import Series, line_chart, time_ticks

    if not report.windows:
        return f'<p class="note">No window records on <code>{escape(report.topics.metrics)}</code>.</p>'
    colors, by_adapter = _colors(report), defaultdict(list)
    for w in report.windows:
        by_adapter[w.adapter].append(w)
    ticks, x_label = time_ticks(sorted({w.start_ms for w in report.windows})), "window start (UTC)"

    def series(a: str | None, value: str, what, band: bool = False) -> Series:
        ws = by_adapter[a]
        tips = [f"{_name(a)} · window {_when(w.start_ms, '%H:%M:%S')} ({'closed' if w.closed else 'open'}) · "
                f"{w.episodes} episodes{what(w)}" for w in ws]
        extra = {"low": [w.low for w in ws], "high": [w.high for w in ws], "mid": [w.median for w in ws]}
        return Series(_name(a), colors[a], [w.start_ms for w in ws], [float(getattr(w, value)) for w in ws],
                      **(extra if band else {}), tips=tips)

    def lengths(w: WindowPoint) -> str:
        return f" · mean {_num(w.mean)}, median {_num(w.median)}, min {_num(w.low)}, max {_num(w.high)} tokens"

    tokens = "trainable tokens per episode"
    top = max((w.high for w in report.windows if math.isfinite(w.high)), default=1.0)
    panels = [line_chart([series(a, "mean", lengths, band=len(by_adapter) == 1) for a in by_adapter],
                         title="Episode response length per window" + (" (mean)" if len(by_adapter) > 1 else ""),
                         x_label=x_label, y_label=tokens, x_ticks=ticks, y_min=0)]
    grid = [line_chart([series(a, "mean", lengths, band=True)], title=f"Response length: {_name(a)}",
                       x_label=x_label, y_label=tokens, x_ticks=time_ticks(sorted({w.start_ms for w in ws}), 5),
                       y_min=0, y_max=top * 1.05, width=520, height=280)
            for a, ws in by_adapter.items()] if len(by_adapter) > 1 else []
    after = [line_chart([series(a, "reward", lambda w: f" · mean reward {_num(w.reward, 3)}") for a in by_adapter],
                        title="Mean episode reward per window", x_label=x_label, y_label="raw reward", x_ticks=ticks),
             line_chart([series(a, "episodes", lambda w: "") for a in by_adapter], title="Episodes finished per window",
                        x_label=x_label, y_label="episodes", x_ticks=ticks, y_min=0, height=240)]
    cells = "".join(f'<div class="panel">{chart}</div>' for chart in grid)
    return ("".join(f'<div class="panel">{c}</div>' for c in panels) + (f'<div class="grid">{cells}</div>' if grid
            else "") + "".join(f'<div class="panel">{c}</div>' for c in after))


def _window_table(report: Report) -> str:
    rows = [(escape(_when(w.start_ms, "%H:%M:%S")), escape(_name(w.adapter)), _num(w.episodes), _num(w.mean),
             _num(w.median), _num(w.low), _num(w.high), _num(w.reward, 3), "closed" if w.closed else "open")
            for w in report.windows]
    table = _table(["window start (UTC)", "adapter", "episodes", "mean len", "median len", "min len", "max len",
                    "mean reward", "state"], rows, {2, 3, 4, 5, 6, 7})
    return f"<details><summary>Every window ({len(rows)} rows)</summary>{table}</details>" if rows else ""


def _batch_section(report: Report) -> str:
    from rollout_bus.observe.charts import Bar, bar_chart

    if not report.batches:
        return f'<p class="note">No batch on <code>{escape(report.topics.shards)}</code>' + (
            f" or under <code>{escape(report.shards_dir)}</code>" if report.shards_dir else "") + ".</p>"
    colors = _colors(report)
    samples = [Bar(str(b.seq), [(_name(a), colors.get(a, "#777"), float(n)) for a, n in sorted(
        b.samples_by_adapter.items(), key=lambda item: (item[0] is not None, item[0] or ""))],
        f"batch {b.seq}: {b.samples} samples") for b in report.batches]
    tokens = [Bar(str(b.seq), [("response tokens", "#5b6770", float(b.response_tokens or 0))],
                  f"batch {b.seq}: {_num(b.response_tokens)} response tokens") for b in report.batches]
    rows = [(str(b.seq), escape(", ".join(_name(a) for a in report.adapters if a in b.samples_by_adapter)),
             _num(b.samples),
             _num(b.response_tokens), _num(b.tokens), _num(b.episodes), _num(b.groups), _num(b.dp_size),
             {True: "yes", False: "no", None: "?"}[b.partial], _staleness_cell(b), b.origin) for b in report.batches]
    charts = [bar_chart(samples, title="Samples per batch", x_label="batch seq", y_label="samples"),
              bar_chart(tokens, title="Response tokens per batch", x_label="batch seq", y_label="response tokens")]
    return "".join([*(f'<div class="panel">{chart}</div>' for chart in charts),
        _table(["batch", "adapters", "samples", "response tokens", "tokens", "episodes", "groups", "dp ranks",
                "partial", "staleness mean / max / oldest", "from"], rows, {0, 2, 3, 4, 5, 6, 7})])


_CAUSES = (("aborted", "#d55e00"), ("removed", "#e69f00"), ("stale", "#cc79a7"))


def _count(value: float | None) -> str:
    """A token count (carried as a float in the metrics) as a whole number."""
    return _num(int(value)) if value is not None and math.isfinite(value) else "n/a"


def _flow_section(report: Report) -> str:
    """Who waited (generators behind the staleness gate, the trainer for batches), then per batch the age of
    its samples and the tokens thrown away by cause."""
    from rollout_bus.observe.charts import Bar, Series, bar_chart, line_chart

    flow = report.flow
    if not flow.batches and not flow.sources:
        return (f'<p class="note">No flow metrics on <code>{escape(report.topics.metrics)}</code> (written by '
                "generators, the trainer and the shard writer of this version).</p>")
    parts = []
    if flow.sources:
        def waited(row: dict[str, Any], suffix: str) -> float | None:
            keys = (f"flow/generator/gate_blocked{suffix}", f"flow/trainer/wait{suffix}")
            return next((row["metrics"][k] for k in keys if k in row["metrics"]), None)
        rows = [(escape(r["stage"]), f'<code>{escape(r["source"])}</code>', _num(waited(r, "_s")),
                 _num(waited(r, "_fraction"), 3), _num(r["elapsed_s"]), "yes" if r["final"] else "no")
                for r in flow.sources]
        parts.append(_table(["stage", "source", "waited s", "fraction of its time", "elapsed s", "ended"], rows,
                            {2, 3, 4}))
    aged = [(seq, m) for seq, m in flow.batches.items() if "flow/sample_age_s/p50" in m]
    if aged:
        def age(name: str, color: str, key: str) -> Series:
            return Series(name, color, [float(s) for s, _ in aged], [m[key] for _, m in aged],
                          tips=[f"batch {s}: {name} {_num(m[key], 2)} s" for s, m in aged])
        ages = [age("p50", "#0072b2", "flow/sample_age_s/p50"), age("p99", "#d55e00", "flow/sample_age_s/p99")]
        chart = line_chart(ages, title="Sample age when its batch is written", x_label="batch seq",
                           y_label="seconds since the final turn", y_min=0)
        parts.append(f'<div class="panel">{chart}</div>')
    if flow.batches:
        bars = [Bar(str(seq), [(cause, color, m.get(f"flow/discarded_tokens/{cause}", 0.0))
                               for cause, color in _CAUSES],
                    f"batch {seq}: " + ", ".join(f"{cause} {_count(m.get(f'flow/discarded_tokens/{cause}'))}"
                                                 for cause, _ in _CAUSES)
                    + f" of {_count(m.get('flow/response_tokens'))} response tokens") for seq, m in flow.batches.items()]
        chart = bar_chart(bars, title="Discarded response tokens per batch, by cause", x_label="batch seq",
                          y_label="tokens")
        parts.append(f'<div class="panel">{chart}</div>')
        rows = [(str(seq), _num(m.get("flow/sample_age_s/p50"), 2), _num(m.get("flow/sample_age_s/p99"), 2),
                 _count(m.get("flow/response_tokens")),
                 *(_num(m.get(f"flow/discarded_token_fraction/{cause}"), 3) for cause, _ in _CAUSES))
                for seq, m in flow.batches.items()]
        parts.append(_table(["batch", "age p50 s", "age p99 s", "response tokens",
                             *(f"{cause} fraction" for cause, _ in _CAUSES)], rows, {0, 1, 2, 3, 4, 5, 6}))
    return "".join(parts)


def _staleness_cell(row: BatchRow) -> str:
    """Trainer steps behind, per scope: ``mean / max / oldest`` (an adapter's name first when scoped)."""
    def number(value: Any) -> str:
        return _num(value, 2) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"
    return "<br>".join(f'<span class="nowrap">{escape(r["adapter"] + ": ") if r["adapter"] is not None else ""}'
                       f'{number(r["mean"])} / {number(r["max"])} / {number(r["oldest"])}</span>'
                       for r in row.staleness) or "n/a"


def _dlq_section(report: Report) -> str:
    if not report.dlq:
        return f'<p class="note">No dead letters on <code>{escape(report.topics.dlq)}</code>: nothing was rejected.</p>'
    rows = []
    for g in report.dlq:
        reasons = "<br>".join(escape(r[:400] + ("…" if len(r) > 400 else "")) for r in g.examples)
        rows.append((f'<span class="nowrap">{escape(g.stage)}</span>', f'<span class="nowrap">{escape(g.kind)}</span>',
                     _num(g.count), f'<div class="reason">{reasons}</div>',
                     '<div class="reason nowrap">' + "<br>".join(escape(s) for s in g.sources) + "</div>"))
    return _table(["stage", "kind", "count", "example reasons", "example sources"], rows, {2})


def _summary(report: Report) -> str:
    span = (report.last_ms - report.first_ms) / 1000 if report.first_ms and report.last_ms else None
    cards = [("episodes", _num(report.episodes), ""), ("windows", _num(len({w.start_ms for w in report.windows})), ""),
             ("batches", _num(len(report.batches)), ""),
             ("samples in batches", _num(sum(sum(b.samples_by_adapter.values()) for b in report.batches)), ""),
             ("dead letters", _num(report.dlq_total), "bad" if report.dlq_total else "good"),
             ("time span", f"{span:,.0f} s" if span is not None else "n/a", "")]
    html = "".join(f'<div class="card {c}"><div class="v">{v}</div><div class="k">{escape(k)}</div></div>'
                   for k, v, c in cards)
    colors = _colors(report)
    legend = " ".join(f'<span class="swatch" style="background:{colors[a]}"></span>{escape(_name(a))}'
                      for a in report.adapters) or "none"
    counts = " · ".join(f"{escape(t[len(report.topics.prefix):])} {report.counts[t]:,}"
                        for t in report.topics.names() if t in report.counts)
    lines = [f"Run <code>{escape(report.topics.prefix or '(no prefix)')}</code> · from {_when(report.first_ms)} "
             f"to {_when(report.last_ms)}", f"Adapters: {legend}" + (
                 f" (filtered to {escape(', '.join(report.adapter_filter))})" if report.adapter_filter else ""),
             f"Records per topic: {counts or 'n/a'}"]
    return f'<div class="cards">{html}</div>' + "".join(f'<p class="note">{line}</p>' for line in lines)


def _learning_section(report: Report) -> list[str]:
    """With a trainer's rows: the reward against batch and wall time, the verdict, every batch."""
    curve = report.learning
    if curve is None:
        return []
    rows = [(str(p.seq), f"{p.reward:.3f}", f"{p.loss:.4f}", f"{p.mismatch_max:.1e}", f"{p.full_vocab_mismatch_mean:.3f}",
             f"{p.staleness_max:.0f}", f"{p.elapsed_s:.1f}") for p in curve.points]
    head = ("batch", "reward", "loss", "mismatch max", "full-vocab gap", "staleness max", "seconds")
    return ["<h2>Learning</h2>",
            '<p class="note">From the trainer\'s <code>trained.jsonl</code>: the mean raw reward of each trained batch; '
            "mismatch: the trainer's log-prob at the token's own weights minus the generator's, over the support; "
            "full-vocab gap: what ignoring the support would add.</p>",
            f'<p class="note">{escape(curve.verdict().describe())}</p>',
            *(f'<div class="panel">{chart}</div>' for chart in reward_charts(curve)),
            _table(head, rows, numeric=set(range(len(head))))]


def render_html(report: Report) -> str:
    """The whole page (see the module contract)."""
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(report.title)}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>{escape(report.title)}</h1>",
        f'<p class="sub">Generated {_when(int(time.time() * 1000))} by <code>rollout-bus report</code></p>',
        _summary(report),
        "<h2>Episodes per window</h2>",
        '<p class="note">Solid line: mean; dashed: median; shaded band: min to max, over the episodes that finished '
        "in each tumbling event-time window, per adapter. Hover a point for its numbers.</p>",
        _window_charts(report), _window_table(report),
        "<h2>Batches</h2>", '<p class="note">Trainer batches written, from their manifests.</p>',
        _batch_section(report),
        "<h2>Flow</h2>", '<p class="note">Who waited: each generator behind the staleness bound, the trainer for its '
        "next batch. Per batch: how old its samples were when it was written (from each episode's final turn), "
        "and which response tokens never train, by cause.</p>",
        _flow_section(report),
        "<h2>Dead letters</h2>", '<p class="note">Records rejected by a stage, by stage and kind.</p>',
        _dlq_section(report), *_learning_section(report), "</main></body></html>"])
