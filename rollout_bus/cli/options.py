"""Flag definitions shared by several subcommands, so each means the same thing everywhere."""

from __future__ import annotations

import typer

BOOTSTRAP = typer.Option(
    None, "--bootstrap-servers", envvar="ROLLOUT_BUS_BOOTSTRAP_SERVERS",
    help="Kafka bootstrap servers (host:port,...). Unset: the local broker started by `rollout-bus kafka start`.",
)
TOPIC_PREFIX = typer.Option(None, "--topic-prefix", envvar="ROLLOUT_BUS_TOPIC_PREFIX",
                            help="Prefix for every topic name, so several runs can share a cluster.")
PORT = typer.Option(9092, "--port", envvar="ROLLOUT_BUS_LOCAL_PORT",
                    help="Port of the local broker (its controller listens on port + 1).")
DATA_DIR = typer.Option(None, "--data-dir", envvar="ROLLOUT_BUS_KAFKA_DATA_DIR",
                        help="State directory of the local broker (default: ~/.cache/rollout-bus/broker-PORT).")
