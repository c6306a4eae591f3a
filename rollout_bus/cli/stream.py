"""``rollout-bus stream``: the Faust stream worker (merges turns into episodes, windowed metrics).

Thin: parse flags, build ``KafkaSettings`` and ``StreamSettings`` (flags, then ``ROLLOUT_BUS_*``,
then defaults), call ``rollout_bus.streams.worker.run_worker``, exit with its status. A ``--data-dir`` that is a
file, read-only or unreadable, or a bad ``--topic-prefix``, is refused in one line (exit 2) before anything.
"""

from __future__ import annotations


import typer

from rollout_bus.cli import options
from rollout_bus.config import StreamSettings


def stream(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    port: int = options.PORT,
    app_id: str | None = typer.Option(None, "--app-id", help="Faust app id: the consumer group and the prefix "
                                      "of the state changelog topic, both after the topic prefix. Workers with one "
                                      "id share the work."),
    window_seconds: float | None = typer.Option(None, "--window-seconds", help="Tumbling metrics window size."),
    grace_seconds: float | None = typer.Option(None, "--grace-seconds",
                                               help="Event-time grace before a window closes."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Faust's working directory (state is in memory "
                                        "and in the changelog; this holds only Faust's own files)."),
    stats_interval: float | None = typer.Option(None, "--stats-interval", help="Seconds between count logs."),
    replication_factor: int | None = typer.Option(None, "--replication-factor", min=1,
                                                  help="Replicas of the topics it creates and of its state "
                                                       "changelog (3 on a three-broker cluster; default 1)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Run a stream worker until interrupted: rollout.turns in; rollout.episodes, rollout.metrics, rollout.dlq out."""
    from rollout_bus.streams.worker import run_worker  # the stage is imported only when the command runs

    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix, local_port=port)
    settings = options.role_settings(StreamSettings, app_id=app_id, window_seconds=window_seconds,
                                     window_grace_seconds=grace_seconds, data_dir=data_dir,
                                     stats_interval_seconds=stats_interval, replication_factor=replication_factor)
    options.writable_dir(settings.data_dir or None, "--data-dir")  # before a topic is made or a file written
    topics = kafka.topics()
    status = run_worker(app_id=topics.group(settings.app_id), client_kwargs=kafka.client_kwargs(), topics=topics,
                        window_seconds=settings.window_seconds, grace_seconds=settings.window_grace_seconds,
                        data_dir=settings.data_dir or None, stats_interval_s=settings.stats_interval_seconds,
                        commit_interval_s=settings.commit_interval_seconds,
                        replication_factor=settings.replication_factor, max_record_bytes=kafka.max_record_bytes)
    raise typer.Exit(status)


if __name__ == "__main__":  # python -m rollout_bus.cli.stream
    typer.run(stream)
