"""The report a demo prints at its end: the batch metrics table, what the run adds beside it (the prompt ledger
of a run from prompts), the flow tables, and the run's accounting in one line.

Why a module of its own: every kind of demo run (``demo.run.DemoRun`` and ``demo.prompts_run.PromptsDemoRun``)
ends with the same report. Contract: ``print_report(console, run, result, metrics_records, elapsed_s)`` prints
it; ``run`` gives ``out`` (the shards under ``out/shards``), ``topics`` and ``report_lines()``; ``result`` is the
final reconciliation (None: the generators said nothing). What a line quotes is printed as data, never markup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from rollout_bus.observe.accounting import Reconciliation, written_batches
from rollout_bus.observe.flow_fold import fold_flow
from rollout_bus.observe.flow_tables import flow_tables
from rollout_bus.wire.metrics_records import METRIC_PREFIX

if TYPE_CHECKING:
    from rollout_bus.demo.run import DemoRun


def _metrics_table(batches: dict[str, dict[str, Any]], width: int) -> Table:
    limit = max(1, min(6, (width - 50) // 12))  # as many batch columns as fit beside full metric names
    shown = list(batches.items())[-limit:]
    table = Table(title=f"batch metrics (last {len(shown)} of {len(batches)} batches)", show_lines=False)
    table.add_column("metric", no_wrap=True, min_width=44)
    for name, _ in shown:
        table.add_column(name.replace("batch-", "#"), justify="right")
    names = sorted({k for _, m in shown for k in m.get("metrics", {})})
    for metric in names:
        cells = []
        for _, manifest in shown:
            value = manifest.get("metrics", {}).get(metric)
            cells.append("" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value)))
        table.add_row(metric if metric.startswith(METRIC_PREFIX) else f"{METRIC_PREFIX}{metric}", *cells)
    return table


def print_report(console: Console, run: DemoRun, result: Reconciliation | None, metrics_records: list[dict],
                 elapsed_s: float) -> None:
    batches = written_batches(run.out / "shards")
    if batches:
        console.print(_metrics_table(batches, console.width))
    for line in run.report_lines():
        console.print(line, markup=False, soft_wrap=True)
    for table in flow_tables(fold_flow(metrics_records)):
        console.print(table)
    windows = [v for v in metrics_records if v.get("kind") == "window"]
    closed = [w for w in windows if w.get("closed")]
    console.print(f"window metrics: {len(windows)} records on {run.topics.metrics} ({len(closed)} closed windows)")
    if result is not None:
        console.print(f"episodes sent {result.sent}: {result.in_shards} in shards, {result.in_dlq_only} only in "
                      f"the DLQ ({len(result.valid_in_dlq_only)} of them valid episodes lost); {result.batches} "
                      f"batches; dead letters by stage/kind: {result.dlq_reasons or 'none'}")
        if result.incomplete_groups:
            console.print(f"{len(result.incomplete_groups)} groups written short (manifest complete: false), e.g. "
                          f"{result.incomplete_groups[:5]}", markup=False)
    console.print(f"shards: {(run.out / 'shards').resolve()}  (logs: {(run.out / 'logs').resolve()})")
    console.print(f"finished in {elapsed_s:.1f}s")


