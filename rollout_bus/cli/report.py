"""``rollout-bus report``: one self-contained HTML page about a run, from its topics and shard manifests.

Reads rollout.metrics, rollout.shards and rollout.dlq to their current end
(``rollout_bus.observe.run_reader``: group-less, commits nothing), optionally the manifests under
``--shards DIR``, folds them (``rollout_bus.observe.report``) and writes the page (``rollout_bus.observe.report_html``). Also ``python -m rollout_bus.cli.report``.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.errors import BrokerError
from rollout_bus.observe.learning import learning_curve
from rollout_bus.observe.report import build_report
from rollout_bus.observe.report_html import render_html
from rollout_bus.observe.run_reader import read_run
from rollout_bus.observe.accounting import written_batches
console = Console(stderr=True)


def report(
    out: Path = typer.Option(Path("report.html"), "--out", help="Where to write the HTML page."),
    shards: Path | None = typer.Option(None, "--shards", help="Shard output directory: also read its manifests."),
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    adapter: list[str] = typer.Option([], "--adapter", help="Only these adapters (repeat, or comma-separate)."),
    title: str | None = typer.Option(None, "--title", help="Page title (default: the run's topic prefix)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to read the topics to their end."),
    train: Path | None = typer.Option(None, "--train", help="A trainer's checkpoint directory (`rollout-bus train`): "
                                      "add its reward curve from trained.jsonl."),
) -> None:
    """Write an HTML report of a run: episode lengths and rewards per window, batch sizes, dead letters."""
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    topics = kafka.topics()
    if shards is not None and not shards.is_dir():
        options.say_error(f"--shards {shards} is not a directory")
        raise typer.Exit(2)
    learning = None
    if train is not None:
        from rollout_bus.consumers.feed.training import TRAINED_NAME, read_trained  # torch: only when asked for

        if not (train / TRAINED_NAME).is_file():
            options.say_error(f"--train {train} holds no {TRAINED_NAME}")
            raise typer.Exit(2)
        learning = learning_curve(read_trained(train))
    try:
        run = read_run(kafka.client_kwargs(), topics, timeout_s=timeout)
    except BrokerError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    manifests = list(written_batches(shards).values()) if shards is not None else []
    chosen = [name.strip() for item in adapter for name in item.split(",") if name.strip()]
    page = build_report(run, topics, title=title, adapters=chosen, manifests=manifests,
                        shards_dir=str(shards) if shards is not None else None, learning=learning)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(page), encoding="utf-8")
    console.print(f"report: {out} ({len(page.windows)} window points, {len(page.batches)} batches, "
                  f"{page.dlq_total} dead letters, {page.episodes} episodes)")
    print(out)


if __name__ == "__main__":  # python -m rollout_bus.cli.report
    typer.run(report)
