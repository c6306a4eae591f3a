"""``rollout-bus inspect TOPIC:PARTITION:OFFSET``: one record decoded for a person; thin: parse, fetch, print.

Also ``python -m rollout_bus.cli.inspect``. Works for rollout.turns, rollout.episodes, rollout.dlq
(the dlq.* headers and the original record, decoded when it decodes), rollout.metrics and
rollout.shards (JSON). A short topic name is put under ``--topic-prefix``. ``--json`` prints the
full description (every token) instead. Bad position syntax, an offset out of range or a record
that does not decode: an error on stderr naming what and where, exit 2.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape

from rollout_bus.cli import options
from rollout_bus.errors import RolloutBusError
from rollout_bus.observe.inspect import inspect_position, render
from rollout_bus.wire.positions import Position, parse_position, with_prefix

err = Console(stderr=True, emoji=False)


def inspect(
    position: str = typer.Argument(..., help="TOPIC:PARTITION:OFFSET of the record."),
    json_out: bool = typer.Option(False, "--json", help="Print the record as JSON (every token) instead."),
    head: int = typer.Option(8, "--head", min=0, help="Response tokens shown from the start."),
    tail: int = typer.Option(8, "--tail", min=0, help="Response tokens shown from the end."),
    rows: int = typer.Option(6, "--support-ids", min=1, help="Support ids shown per token."),
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
) -> None:
    """Decode one record and show its key, headers, identity, tokens, loss mask, supports or DLQ reason."""
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    try:
        pos = parse_position(position)
        pos = Position(with_prefix(pos.topic, kafka.topic_prefix), pos.partition, pos.offset)
        description = inspect_position(kafka.client_kwargs(), pos)
    except RolloutBusError as exc:
        err.print("[red]error:[/red] " + escape(str(exc)))
        raise typer.Exit(2) from exc
    if json_out:
        print(json.dumps(description, sort_keys=True, default=str))
    else:
        render(description, Console(emoji=False), head=head, tail=tail, rows=rows)


if __name__ == "__main__":
    typer.run(inspect)
