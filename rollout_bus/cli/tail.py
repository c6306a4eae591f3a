"""``rollout-bus tail``: live metrics of a run, refreshing in place.

The reading and folding are ``rollout_bus.observe.live_feed.MetricsFeed``; this module holds the rest: the
flags, the rich tables a person watches (``render``: windows, latest batch, staleness, dead letters,
lag), and the refresh loop (a live view on a terminal, one snapshot per interval otherwise).

Also ``python -m rollout_bus.cli.tail``. It reads rollout.metrics and rollout.dlq with its own
group-less consumer (assign + seek, commits nothing), by default from the last ``--history``
records of each partition (``--from-beginning``: all of them), and measures the lag of the stream
worker's group on rollout.turns and the shard writer's on rollout.episodes. It also shows the
trainer's live weight version (rollout.weights; ``-`` while there is none) and the latest batch's
staleness per adapter (``staleness/{mean,max,oldest}``: trainer steps behind, token-weighted).
``--once --json`` prints one snapshot (``MetricsView.snapshot``, with ``trainer`` and
``staleness``) after reading up to the current end and exits.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rollout_bus.cli import options
from rollout_bus.config import KafkaSettings, ShardSettings, StreamSettings
from rollout_bus.observe.live_feed import MetricsFeed
from rollout_bus.wire.flow_metrics import (DISCARD_CAUSES, INCOMPLETE_GROUPS, SAMPLE_AGE_P50, SAMPLE_AGE_P99, WAIT_KEYS,
                                           discarded_token_fraction)
from rollout_bus.wire.metrics_records import METRIC_PREFIX

# (metric, column header): headers short enough for an 80-column terminal
WINDOW_COLUMNS = [("episode_response_length/mean", "len mean"), ("episode_response_length/median", "median"),
                  ("episode_response_length/min", "min"), ("episode_response_length/max", "max"),
                  ("episode_total_response_length/mean", "total"), ("episode_raw_reward", "reward")]
BATCH_COLUMNS = [("num_training_samples", "rows"), ("response_len/mean", "resp len"),
                 ("truncated_ratio", "truncated"), ("episode_raw_reward", "reward")]


def stage_groups(kafka: KafkaSettings, stream_group: str | None, shards_group: str | None) -> list[tuple[str, str]]:
    """(group, topic) of the stream worker and the shard writer, scoped by the topic prefix as the stages
    scope them; settings fill what flags leave out."""
    topics = kafka.topics()
    return [(topics.group(stream_group or StreamSettings().app_id), topics.turns),
            (topics.group(shards_group or ShardSettings().group_id), topics.episodes)]


def _short(metrics: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """Metric names without ``rollout/`` and the adapter scope, for display."""
    scoped, scope = f"{METRIC_PREFIX}adapter/", f"{METRIC_PREFIX}adapter/{adapter}/"
    shown = {k.removeprefix(METRIC_PREFIX): v for k, v in metrics.items() if not k.startswith(scoped)}
    shown.update({k[len(scope):]: v for k, v in metrics.items() if adapter is not None and k.startswith(scope)})
    return shown


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1 else f"{value:.3f}"
    return str(value)


def _clock(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%H:%M:%S")


def render(snapshot: dict[str, Any]) -> Group:
    """The tables a person watches: windows, latest batch, its staleness, dead letters, lag."""
    windows = Table(title="latest window per adapter", title_justify="left")
    for column in ["adapter", "from (UTC)", "episodes", "closed", *(h for _, h in WINDOW_COLUMNS)]:
        windows.add_column(column, justify="left" if column in ("adapter", "from (UTC)") else "right")
    for w in snapshot["windows"]:
        shown = _short(w["metrics"], w["adapter"])
        span = f"{_clock(w['window']['start_ms'])} {(w['window']['end_ms'] - w['window']['start_ms']) // 1000}s"
        windows.add_row(str(w["adapter"] or "-"), span, str(w["episodes"]), "yes" if w["closed"] else "no",
                        *[_number(shown.get(m)) for m, _ in WINDOW_COLUMNS])
    batch = Table(title=f"latest batch ({snapshot['batches']} batches, {snapshot['batch_samples']} samples)",
                  title_justify="left")
    for column in ["batch", "samples", *(h for _, h in BATCH_COLUMNS)]:
        batch.add_column(column, justify="right")
    if snapshot["batch"] is not None:
        b = snapshot["batch"]
        shown = _short(b["metrics"], snapshot["adapter"])
        batch.add_row(str(b["batch"]), str(b["samples"]), *[_number(shown.get(m)) for m, _ in BATCH_COLUMNS])
    stale = staleness_table(snapshot)
    flow = flow_table(snapshot)
    dlq = snapshot["dlq"]
    dead = Table(title=f"dead letters ({dlq['counted']} read, {dlq['on_topic']} on the topic)", title_justify="left")
    for column in ["stage", "kind", "count"]:
        dead.add_column(column)
    for row in dlq["by_reason"]:
        dead.add_row(row["stage"], row["kind"], str(row["count"]))
    short = snapshot["flow"]["batch_totals"].get(METRIC_PREFIX + INCOMPLETE_GROUPS)
    if short:  # the end-of-run flush wrote groups without members the run never finished (their DLQ rows above)
        dead.caption = f"{int(short)} groups written short (manifest complete: false)"
    lag = Table(title="consumer lag", title_justify="left")
    for column in ["group", "topic", "partition", "committed", "end", "lag", "log start", "retention"]:
        lag.add_column(column)
    for row in snapshot["lag"]:
        lag.add_row(row["group"], row["topic"], str(row["partition"]), _number(row["committed"]), str(row["end"]),
                    str(row["lag"]), str(row.get("log_start", 0)), _retention_warning(row))
    return Group(windows, batch, stale, flow, dead, lag)


def _retention_warning(row: dict[str, Any]) -> str:
    """What retention did to the group on this partition, in red when it lost records."""
    if row.get("lost"):
        return f"[red]LOST {row['lost']} unread[/red]"
    if row.get("near_log_start"):
        return "[yellow]near the log start: unread records may be deleted[/yellow]"
    return ""


# waited s, then fraction: the key of whichever stage the source is
FLOW_SOURCE_COLUMNS = (tuple(keys.seconds for keys in WAIT_KEYS.values()),
                       tuple(keys.fraction for keys in WAIT_KEYS.values()))
BATCH_FLOW = ((SAMPLE_AGE_P50, "age p50 s"), (SAMPLE_AGE_P99, "age p99 s"),
              *((discarded_token_fraction(cause), cause) for cause in DISCARD_CAUSES))


def flow_table(snapshot: dict[str, Any]) -> Table:
    """Who waits: each generator's time behind the staleness gate and the trainer's waiting for batches (rows),
    then the latest batch's sample age and discarded-token fractions by cause (the title)."""
    b = snapshot.get("batch")
    shown = _short(b["metrics"], snapshot["adapter"]) if b is not None else {}
    batch = ", ".join(f"{head} {_number(shown[key])}" for key, head in BATCH_FLOW if key in shown)
    title = "flow: waiting by source" + (f"; batch {b['batch']}: {batch} (token fractions)" if batch else "")
    table = Table(title=title, title_justify="left")
    for column in ("stage", "source", "waited s", "fraction", "elapsed s", "ended"):
        table.add_column(column, justify="left" if column in ("stage", "source") else "right")
    for row in (snapshot.get("flow") or {}).get("sources", []):
        mine = _short(row["metrics"], None)
        waited, fraction = (next((mine[key] for key in keys if key in mine), None) for keys in FLOW_SOURCE_COLUMNS)
        table.add_row(row["stage"], row["source"], _number(waited), _number(fraction), _number(row["elapsed_s"]),
                      "yes" if row["final"] else "no")
    return table


def staleness_table(snapshot: dict[str, Any]) -> Table:
    """The trainer's live version and the latest batch's staleness (steps behind) per adapter."""
    version = (snapshot.get("trainer") or {}).get("weight_version")
    seq = snapshot["batch"]["batch"] if snapshot.get("batch") is not None else None
    title = f"trainer weight version {_number(version)}; staleness of batch {_number(seq)} (steps behind)"
    table = Table(title=title, title_justify="left", min_width=len(title))
    for column in ["adapter", "mean", "max", "oldest"]:
        table.add_column(column, justify="left" if column == "adapter" else "right")
    for row in snapshot.get("staleness") or []:
        table.add_row(str(row["adapter"] or "-"), *[_number(row[k]) for k in ("mean", "max", "oldest")])
    return table


def tail(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    adapter: str | None = typer.Option(None, "--adapter", help="Show only this adapter's windows, batch "
                                       "metrics and dead letters."),
    from_beginning: bool = typer.Option(False, "--from-beginning", help="Read the topics from their first "
                                        "record (default: the last --history records of each partition)."),
    history: int = typer.Option(1000, "--history", min=0, help="Records per partition read back at start."),
    once: bool = typer.Option(False, "--once", help="Read up to the current end, show one snapshot, exit."),
    json_output: bool = typer.Option(False, "--json", help="Print snapshots as JSON (one line each)."),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between refreshes."),
    stream_group: str | None = typer.Option(None, "--stream-group", help="The stream worker's consumer group "
                                            "(its app id, after the topic prefix; default: ROLLOUT_BUS_APP_ID or rollout-bus-stream)."),
    shards_group: str | None = typer.Option(None, "--shards-group", help="The shard writer's consumer group "
                                            "(after the topic prefix; default: ROLLOUT_BUS_GROUP_ID or rollout-bus-shards)."),
) -> None:
    """Live metrics from rollout.metrics, dead letters by reason, and consumer lag, refreshing in place."""
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    feed = MetricsFeed(kafka.client_kwargs(), kafka.topics(), stage_groups(kafka, stream_group, shards_group),
                       adapter=adapter, history=None if from_beginning else history)
    console = Console()
    try:
        feed.catch_up()
        if once:
            _show(console, feed.snapshot(), json_output)
            return
        if json_output or not console.is_terminal:  # piped or a container log: a snapshot per interval
            while True:
                _show(console, feed.snapshot(), json_output)
                _refresh_for(feed, interval)
        with Live(render(feed.snapshot()), console=console, auto_refresh=False) as live:
            while True:
                _refresh_for(feed, interval)
                live.update(render(feed.snapshot()), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()


def _show(console: Console, snapshot: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(snapshot, sort_keys=True), flush=True)
    else:
        console.print(render(snapshot))


def _refresh_for(feed: MetricsFeed, seconds: float) -> None:
    """Read new records for ``seconds`` (polling returns as soon as records arrive)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        feed.refresh(timeout_ms=max(int(left * 1000), 1))


if __name__ == "__main__":  # python -m rollout_bus.cli.tail
    typer.run(tail)
