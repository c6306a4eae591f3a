"""``rollout-bus replay``: rebuild shards from an offset range and say what differs; thin: parse, run, print.

Also ``python -m rollout_bus.cli.replay``. ``--from`` takes ``TOPIC:PARTITION:OFFSET``,
``TOPIC:PARTITION`` or ``TOPIC`` (every partition from its first offset) and may be repeated;
the topic is rollout.episodes or rollout.turns, prefixed (``run42.rollout.episodes``) or short
under ``--topic-prefix``. ``--to`` is exclusive and applies to every range (default: the end
offsets at start). The consumer joins no group and commits nothing; nothing is published.
Progress goes to stderr, the summary (or ``--json``) to stdout. Exit 0 when every rebuilt batch
matches its manifest (or has none to compare with), 1 when one differs, 2 on bad input.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_bus.config import BatchingSettings
from rollout_bus.cli import options
from rollout_bus.errors import RolloutBusError
from rollout_bus.wire.positions import RangeStart, parse_range_start, with_prefix
from rollout_bus.replay.report import ReplayReport
from rollout_bus.replay.rerun import replay as run_replay

err = Console(stderr=True, emoji=False)
out_console = Console(emoji=False)
MAX_REJECTIONS_SHOWN = 10


def print_summary(report: ReplayReport, console: Console) -> None:
    """What was read and rebuilt, which settings were used and why, and what differs."""
    s = report.settings
    console.print(escape(f"replayed {report.records} records of {report.topic} "
                         f"({', '.join(report.ranges) or 'empty'}): {report.episodes} episodes; batcher {report.counts}"))
    console.print("settings: " + escape(", ".join(f"{n}={getattr(s, n)} ({s.sources[n]})"
                                           for n in ("batching", "dp_size", "groups_per_batch", "normalization"))))
    console.print("compared with: " + escape(report.manifests_from or "no manifests found"))
    for warning in s.warnings:
        console.print("[yellow]warning:[/yellow] " + escape(warning))
    table = Table("batch", "status", "episodes", "in manifest", "detail", title="batches", title_justify="left")
    style = {"identical": "green", "differs": "red", "incomplete": "yellow", "dead-lettered": "magenta"}
    for b in report.batches:
        colour = style.get(b.status, "")
        status = f"[{colour}]{b.status}[/{colour}]" if colour else b.status
        table.add_row(str(b.seq), status, str(b.episodes), "-" if b.expected_episodes is None else
                      str(b.expected_episodes), escape(b.detail))
    console.print(table)
    console.print("totals: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_status().items())))
    if report.open_episodes:
        console.print(f"{report.open_episodes} episodes still open (their final turn is outside the range)")
    if report.rejections:
        console.print(f"{len(report.rejections)} records the stages would dead-letter:")
        for r in report.rejections[:MAX_REJECTIONS_SHOWN]:
            console.print(escape(f"  {r.stage}/{r.kind} {r.source}: {r.reason[:200]}"))


def replay(
    from_: list[str] = typer.Option(..., "--from", help="TOPIC:PARTITION:OFFSET, TOPIC:PARTITION or TOPIC "
                                                         "(all partitions from the start); repeatable."),
    to: int | None = typer.Option(None, "--to", min=0, help="Stop offset, EXCLUSIVE, for every range "
                                                            "(default: the end offsets at start)."),
    out: Path = typer.Option(..., "--out", help="New directory for the rebuilt batch-*/ shards."),
    compare: Path | None = typer.Option(None, "--compare", help="Original shards directory to compare with "
                                                                "(read only). Default: the run's rollout.shards."),
    announced: bool = typer.Option(True, "--announced/--no-announced",
                                   help="Without --compare, compare with the manifests announced on rollout.shards."),
    partial: bool = typer.Option(False, "--partial", help="Also write batches only partly inside the range."),
    batching: str | None = typer.Option(None, "--batching", help="step or arrival (default: from the manifests, "
                                        f"else the run default, {BatchingSettings.model_fields['batching'].default})."),
    dp_size: int | None = typer.Option(None, "--dp-size", help="DP ranks (default: from the manifests)."),
    groups_per_batch: int | None = typer.Option(None, "--groups-per-batch", min=1,
                                                help="Prompt groups per batch (default: inferred from the manifests, "
                                                     "else the run default, "
                                                     f"{BatchingSettings.model_fields['groups_per_batch'].default})."),
    normalization: str | None = typer.Option(None, "--normalization",
                                             help="none, grpo or grpo_std (default: from the manifests)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
) -> None:
    """Rebuild shards from rollout.episodes or rollout.turns offsets with the shard writer's code; compare."""
    logging.getLogger("rollout_bus.streams").setLevel(logging.ERROR)  # what the offline merge rejects is in the summary
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    flags = {"batching": batching, "dp_size": dp_size, "groups_per_batch": groups_per_batch,
             "normalization": normalization}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    try:
        starts = [parse_range_start(text) for text in from_]
        starts = [RangeStart(with_prefix(s.topic, kafka.topic_prefix), s.partition, s.offset) for s in starts]
        with Progress(*columns, console=err, transient=False) as progress:
            task = progress.add_task("records read", total=None)
            report = run_replay(kafka.client_kwargs(), starts, out_dir=out, to=to, flags=flags, compare_dir=compare,
                                use_announcements=announced, write_partial=partial,
                                progress=lambda done, total: progress.update(task, completed=done, total=total))
    except RolloutBusError as exc:
        err.print("[red]error:[/red] " + escape(str(exc)))
        raise typer.Exit(2) from exc
    if json_out:
        print(json.dumps(report.as_json(), sort_keys=True, default=str))
    else:
        print_summary(report, out_console)
    raise typer.Exit(1 if report.differs else 0)


if __name__ == "__main__":
    typer.run(replay)
