"""``rollout-bus report``: one self-contained HTML page about a run, from its topics and shard manifests.

Reads rollout.metrics, rollout.shards and rollout.dlq from the beginning to their current end with
its own group-less consumer (commits nothing, so it can run beside the stages or long after),
optionally the manifests under ``--shards DIR``, folds them (``rollout_bus.ops.report``) and writes
the page. Also ``python -m rollout_bus.cli.report``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.dead_letter import DeadLetter
from rollout_bus.errors import BrokerError
from rollout_bus.ops.report import RawRun, build_report, render_html
from rollout_bus.ops.topic_reader import TopicReader
from rollout_bus.pipeline.accounting import written_batches
from rollout_bus.topics import Topics

logger = logging.getLogger(__name__)
console = Console(stderr=True)


def _present(client_kwargs: dict[str, Any], topics: Topics) -> list[str]:
    """The run's topics that exist; BrokerError naming the runs there are when none does."""
    consumer = KafkaConsumer(**client_kwargs, group_id=None, enable_auto_commit=False, client_id="rollout-bus-report")
    try:
        found = consumer.topics()
    finally:
        consumer.close()
    present = [name for name in topics.names() if name in found]
    if not present:
        suffix = "rollout.metrics"
        runs = sorted(t[: -len(suffix)] or "(no prefix)" for t in found if t.endswith(suffix))
        latest = [r for r in runs if r.startswith("demo-")][-6:] or runs[-6:]  # demo prefixes sort by time
        raise BrokerError(f"no topic {topics.metrics!r} (nor any other of this run) on the cluster; "
                          f"{len(runs)} runs there, e.g. --topic-prefix {' | '.join(latest) or '(none)'}")
    return present


def _counts(consumer: KafkaConsumer, names: list[str]) -> dict[str, int]:
    """Records ever written to each topic (the sum of its partitions' end offsets)."""
    counts = {}
    for name in names:
        partitions = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or [])]
        try:
            counts[name] = sum(consumer.end_offsets(partitions).values()) if partitions else 0
        except (KeyError, KafkaError):  # a partition without a leader right now: leave the count out
            continue
    return counts


def read_run(client_kwargs: dict[str, Any], topics: Topics, *, timeout_s: float = 60.0) -> RawRun:
    """Everything on the run's metrics, shards and DLQ topics now, and every topic's record count."""
    present = _present(client_kwargs, topics)
    names = [t for t in (topics.metrics, topics.shards, topics.dlq) if t in present]
    reader = TopicReader(client_kwargs, names)
    try:
        records = reader.read_to_end(timeout_s)
        counts = _counts(reader.consumer, present)
    finally:
        reader.close()
    stamps = [r.timestamp for batch in records.values() for r in batch if r.timestamp and r.timestamp > 0]
    run = RawRun(counts=counts, first_ms=min(stamps, default=None), last_ms=max(stamps, default=None))
    run.metrics = _json_values(records.get(topics.metrics, []))
    run.announcements = _json_values(records.get(topics.shards, []))
    run.dead_letters = [DeadLetter.from_record(r.key, r.value, r.headers) for r in records.get(topics.dlq, [])]
    return run


def _json_values(records: list) -> list[dict]:
    values = []
    for record in records:
        try:
            doc = json.loads(record.value)
        except (TypeError, ValueError):
            logger.warning("skipped a record that is not JSON topic=%s offset=%s", record.topic, record.offset)
            continue
        if isinstance(doc, dict):
            values.append(doc)
    return values


def report(
    out: Path = typer.Option(Path("report.html"), "--out", help="Where to write the HTML page."),
    shards: Path | None = typer.Option(None, "--shards", help="Shard output directory: also read its manifests."),
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    adapter: list[str] = typer.Option([], "--adapter", help="Only these adapters (repeat, or comma-separate)."),
    title: str | None = typer.Option(None, "--title", help="Page title (default: the run's topic prefix)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to read the topics to their end."),
) -> None:
    """Write an HTML report of a run: episode lengths and rewards per window, batch sizes, dead letters."""
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    topics = kafka.topics()
    if shards is not None and not shards.is_dir():
        console.print(f"[red]error:[/red] --shards {shards} is not a directory")
        raise typer.Exit(2)
    try:
        run = read_run(kafka.client_kwargs(), topics, timeout_s=timeout)
    except BrokerError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    manifests = list(written_batches(shards).values()) if shards is not None else []
    chosen = [name.strip() for item in adapter for name in item.split(",") if name.strip()]
    page = build_report(run, topics, title=title, adapters=chosen, manifests=manifests,
                        shards_dir=str(shards) if shards is not None else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(page), encoding="utf-8")
    console.print(f"report: {out} ({len(page.windows)} window points, {len(page.batches)} batches, "
                  f"{page.dlq_total} dead letters, {page.episodes} episodes)")
    print(out)


if __name__ == "__main__":  # python -m rollout_bus.cli.report
    typer.run(report)
