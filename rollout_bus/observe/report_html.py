"""The run report as one self-contained HTML page: ``render_html(report)`` of what ``observe.report`` folded.

Contract: ``render_html(report)`` returns one HTML document with no external resources (inline CSS and SVG,
no scripts); every value from the run is escaped. Sections: a summary, episodes per window (charts and
a table), batches, flow (who waited, sample age, discarded tokens by cause: the names are
``wire.flow_metrics``'), dead letters, and with a trainer's rows the learning curve. Pure: no Kafka, no files.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from html import escape
from typing import Any, Iterable, Sequence

from rollout_bus.observe.charts import Bar, Series, bar_chart, color_for, line_chart, time_ticks
from rollout_bus.observe.flow_fold import Flow
from rollout_bus.observe.learning import reward_charts
from rollout_bus.observe.report import BatchRow, Report, WindowPoint
from rollout_bus.wire.flow_metrics import (CAUSE_ABORTED, CAUSE_REMOVED, CAUSE_STALE, CAUSE_TAKEOVER, DISCARD_CAUSES,
                                           RESPONSE_TOKENS, SAMPLE_AGE_P50, SAMPLE_AGE_P99, WAIT_KEYS,
                                           discarded_token_fraction, discarded_tokens)

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
    order = list(report.color_order) + [a for a in report.adapters if a not in report.color_order]
    return {a: color_for(i) for i, a in enumerate(order)}


def _name(adapter: str | None) -> str:
    return adapter if adapter is not None else "(no adapter)"


def _window_charts(report: Report) -> str:
    """Means of every adapter on one chart; each adapter's min-max band on its own (shared scale)."""
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


_CAUSE_COLORS = {CAUSE_ABORTED: "#d55e00", CAUSE_REMOVED: "#e69f00", CAUSE_STALE: "#cc79a7",
                 CAUSE_TAKEOVER: "#009e73"}


def _count(value: float | None) -> str:
    """A token count (carried as a float in the metrics) as a whole number."""
    return _num(int(value)) if value is not None and math.isfinite(value) else "n/a"


def _waited(row: dict[str, Any], field: str) -> float | None:
    """A source's ``WaitKeys`` ``field`` (seconds or fraction), whichever stage's key its metrics hold."""
    keys = [getattr(keys, field) for keys in WAIT_KEYS.values()]
    return next((row["metrics"][k] for k in keys if k in row["metrics"]), None)


def _waiting_table(flow: Flow) -> str:
    rows = [(escape(r["stage"]), f'<code>{escape(r["source"])}</code>', _num(_waited(r, "seconds")),
             _num(_waited(r, "fraction"), 3), _num(r["elapsed_s"]), "yes" if r["final"] else "no")
            for r in flow.sources]
    return _table(["stage", "source", "waited s", "fraction of its time", "elapsed s", "ended"], rows, {2, 3, 4})


def _age_chart(aged: list[tuple[int, dict[str, float]]]) -> str:
    def age(name: str, color: str, key: str) -> Series:
        return Series(name, color, [float(s) for s, _ in aged], [m[key] for _, m in aged],
                      tips=[f"batch {s}: {name} {_num(m[key], 2)} s" for s, m in aged])
    ages = [age("p50", "#0072b2", SAMPLE_AGE_P50), age("p99", "#d55e00", SAMPLE_AGE_P99)]
    chart = line_chart(ages, title="Sample age when its batch is written", x_label="batch seq",
                       y_label="seconds since the final turn", y_min=0)
    return f'<div class="panel">{chart}</div>'


def _discarded(flow: Flow) -> list[str]:
    """The discarded response tokens per batch by cause (a chart), and each batch's age and fractions (a table)."""
    bars = [Bar(str(seq), [(cause, _CAUSE_COLORS[cause], m.get(discarded_tokens(cause), 0.0))
                           for cause in DISCARD_CAUSES],
                f"batch {seq}: " + ", ".join(f"{cause} {_count(m.get(discarded_tokens(cause)))}"
                                             for cause in DISCARD_CAUSES)
                + f" of {_count(m.get(RESPONSE_TOKENS))} response tokens") for seq, m in flow.batches.items()]
    chart = bar_chart(bars, title="Discarded response tokens per batch, by cause", x_label="batch seq",
                      y_label="tokens")
    rows = [(str(seq), _num(m.get(SAMPLE_AGE_P50), 2), _num(m.get(SAMPLE_AGE_P99), 2),
             _count(m.get(RESPONSE_TOKENS)),
             *(_num(m.get(discarded_token_fraction(cause)), 3) for cause in DISCARD_CAUSES))
            for seq, m in flow.batches.items()]
    return [f'<div class="panel">{chart}</div>',
            _table(["batch", "age p50 s", "age p99 s", "response tokens",
                    *(f"{cause} fraction" for cause in DISCARD_CAUSES)], rows,
                   set(range(4 + len(DISCARD_CAUSES))))]


def _flow_section(report: Report) -> str:
    """Who waited (generators behind the staleness gate, the trainer for batches), then per batch the age of
    its samples and the tokens thrown away by cause."""
    flow = report.flow
    if not flow.batches and not flow.sources:
        return (f'<p class="note">No flow metrics on <code>{escape(report.topics.metrics)}</code> (written by '
                "generators, the trainer and the shard writer of this version).</p>")
    parts = [_waiting_table(flow)] if flow.sources else []
    aged = [(seq, m) for seq, m in flow.batches.items() if SAMPLE_AGE_P50 in m]
    if aged:
        parts.append(_age_chart(aged))
    if flow.batches:
        parts += _discarded(flow)
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
