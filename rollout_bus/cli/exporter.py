"""``rollout-bus exporter``: a Prometheus endpoint for a run; thin: parse, build the feed, serve.

Also ``python -m rollout_bus.cli.exporter``. It reads rollout.metrics and rollout.dlq from the
beginning (so its counters survive a restart: ``rollout_bus.observe.exporter``), then serves
``/metrics`` on ``--bind``:``--port`` and refreshes every ``--interval`` seconds until interrupted.
"""

from __future__ import annotations

import signal

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.cli.tail import stage_groups
from rollout_bus.observe.exporter import Exporter
from rollout_bus.observe.live_feed import MetricsFeed

console = Console(stderr=True)


def exporter(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    port: int = typer.Option(9464, "--port", "--listen-port", help="HTTP port of /metrics (0: any free port)."),
    bind: str = typer.Option("127.0.0.1", "--bind", "--listen-host", help="Address to listen on "
                             "(0.0.0.0 in a container)."),
    interval: float = typer.Option(5.0, "--interval", min=0.1, help="Seconds between refreshes."),
    stream_group: str | None = typer.Option(None, "--stream-group", help="The stream worker's consumer group "
                                            "(its app id, after the topic prefix; default: ROLLOUT_BUS_APP_ID or rollout-bus-stream)."),
    shards_group: str | None = typer.Option(None, "--shards-group", help="The shard writer's consumer group "
                                            "(after the topic prefix; default: ROLLOUT_BUS_GROUP_ID or rollout-bus-shards)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Serve the latest window and batch metrics, record counters and consumer lag to Prometheus."""
    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    feed = MetricsFeed(kafka.client_kwargs(), kafka.topics(), stage_groups(kafka, stream_group, shards_group))
    server = Exporter(feed, interval_s=interval)
    signal.signal(signal.SIGTERM, lambda *_: server.stopped.set())
    try:
        server.serve(bind, port, on_ready=lambda url: console.print(f"exporter: serving {url}", highlight=False))
    except KeyboardInterrupt:
        pass
    finally:
        feed.close()


if __name__ == "__main__":  # python -m rollout_bus.cli.exporter
    typer.run(exporter)
