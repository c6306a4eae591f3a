"""``rollout-bus topics create|list``: the pipeline's topics, from ``rollout_bus.wire.topics``.

``create`` waits until the cluster answers, then creates every missing pipeline topic
(``rollout_bus.kafka.admin.ensure_topics``) with the given partition counts and replication factor,
and ``max.message.bytes`` from ``ROLLOUT_BUS_MAX_RECORD_BYTES``; topics that exist keep their
partitions (and only have a too-small record size limit raised). It is what the
one-shot ``topics`` service of compose/docker-compose.yml runs before any stage starts, so no stage
creates a topic with its own defaults. ``list`` needs no broker: it prints each topic's name, what
it carries and its key. Also ``python -m rollout_bus.cli.topics``.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rollout_bus.cli import options
from rollout_bus.errors import BrokerError
from rollout_bus.kafka.admin import ensure_topics, wait_for_cluster
from rollout_bus.wire.topics import Topics

app = typer.Typer(help="Create or list the pipeline's Kafka topics.", no_args_is_help=True)
console = Console(stderr=True)

TURNS_PARTITIONS = typer.Option(None, "--turns-partitions", envvar="ROLLOUT_BUS_TURNS_PARTITIONS", min=1,
                                help="Partitions of rollout.turns: the most stream workers that can share the work.")
EPISODES_PARTITIONS = typer.Option(None, "--episodes-partitions", envvar="ROLLOUT_BUS_EPISODES_PARTITIONS", min=1,
                                   help="Partitions of rollout.episodes.")


def _topics(prefix: str | None, turns_partitions: int | None, episodes_partitions: int | None) -> Topics:
    defaults = Topics()
    return Topics(prefix=prefix or "", turns_partitions=turns_partitions or defaults.turns_partitions,
                  episodes_partitions=episodes_partitions or defaults.episodes_partitions)


@app.command()
def create(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    port: int = options.PORT,
    turns_partitions: int | None = TURNS_PARTITIONS,
    episodes_partitions: int | None = EPISODES_PARTITIONS,
    replication_factor: int = typer.Option(1, "--replication-factor", envvar="ROLLOUT_BUS_REPLICATION_FACTOR", min=1,
                                           help="Replicas of every topic (3 on a three-broker cluster)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for the cluster to answer."),
) -> None:
    """Create every missing pipeline topic; print the names created."""
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix, local_port=port)
    kwargs = kafka.client_kwargs()
    topics = _topics(kafka.topic_prefix, turns_partitions, episodes_partitions)
    try:
        wait_for_cluster(kwargs, timeout)  # a one-shot service may start before the broker serves requests
        created = ensure_topics(kwargs, topics, replication_factor=replication_factor,
                                max_record_bytes=kafka.max_record_bytes)
    except BrokerError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    except Exception as exc:  # kafka-python's errors (authorization, invalid replication factor, ...)
        options.say_error(f"creating topics at {kwargs['bootstrap_servers']} failed: {exc!r}")
        raise typer.Exit(1) from exc
    kept = [name for name in topics.names() if name not in created]
    console.print(f"topics at {kwargs['bootstrap_servers']}: {len(created)} created "
                  f"(replication {replication_factor}), {len(kept)} already there")
    for name in created:
        print(name)


@app.command("list")
def list_topics(
    topic_prefix: str | None = options.TOPIC_PREFIX,
    turns_partitions: int | None = TURNS_PARTITIONS,
    episodes_partitions: int | None = EPISODES_PARTITIONS,
) -> None:
    """Print each pipeline topic: its name, what it carries, its key, its partitions (no broker needed)."""
    table = Table("topic", "carries", "key", "partitions", title="rollout-bus topics")
    for spec in _topics(topic_prefix, turns_partitions, episodes_partitions).specs():
        table.add_row(escape(spec.name), escape(spec.carries), escape(spec.key), str(spec.partitions))
    Console().print(table)


if __name__ == "__main__":  # python -m rollout_bus.cli.topics
    app()
