"""Flags shared by several subcommands, so each means the same thing everywhere, and what they settle.

``kafka_settings`` builds the connection settings from the flags a user set (environment variables
and defaults fill the rest); ``configure_logging`` is the one logging setup of every command, also
when a stage runs as ``python -m rollout_bus.cli.<stage>``.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import typer
from pydantic import ValidationError

from rollout_bus.kafka.client_logs import quiet_client_logs
from rollout_bus.config import BatchingSettings, KafkaSettings

NOISY_LOGGERS = ("kafka", "aiokafka", "faust", "mode")
S = TypeVar("S")


def given(**values: object) -> dict[str, object]:
    """Only the flags the user set, so environment variables and defaults fill the rest."""
    return {k: v for k, v in values.items() if v is not None}


def role_settings(cls: type[S], **flags: object) -> S:
    """A role's settings from the flags a user set; a value out of range is a usage error naming it."""
    try:
        return cls(**given(**flags))
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from exc


def kafka_settings(bootstrap_servers: str | None, topic_prefix: str | None, **more: object) -> KafkaSettings:
    """The connection settings; an unusable one (a prefix Kafka would refuse) is a usage error naming it."""
    try:
        return KafkaSettings(**given(bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix, **more))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise typer.BadParameter(problems) from exc


def configure_logging(verbose: bool = False) -> None:
    """Stable key=value log lines on stderr; third-party clients only warn unless --verbose, and a Kafka
    client's repeated complaints are thinned (``rollout_bus.kafka.client_logs``)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.WARNING)
    quiet_client_logs()  # Kafka clients' complaints during an outage: one line per kind every 10 s

BOOTSTRAP = typer.Option(
    None, "--bootstrap-servers", envvar="ROLLOUT_BUS_BOOTSTRAP_SERVERS",
    help="Kafka bootstrap servers (host:port,...). Unset: the local broker started by `rollout-bus kafka start`.",
)
TOPIC_PREFIX = typer.Option(None, "--topic-prefix", envvar="ROLLOUT_BUS_TOPIC_PREFIX",
                            help="Prefix for every topic name, so several runs can share a cluster.")
PORT = typer.Option(9092, "--port", envvar="ROLLOUT_BUS_LOCAL_PORT", min=1, max=65534,
                    help="Port of the local broker (its controller listens on port + 1).")
DATA_DIR = typer.Option(None, "--data-dir", envvar="ROLLOUT_BUS_KAFKA_DATA_DIR",
                        help="State directory of the local broker (default: ~/.cache/rollout-bus/broker-PORT).")

# The run's batching (``config.BatchingSettings``): the same flags, help and default for generate, shards,
# demo and replay; the generator and the shard writer declare them on rollout.run and refuse a mismatch.
_BATCHING_DEFAULTS = BatchingSettings.model_fields
GROUPS_PER_BATCH = typer.Option(
    None, "--groups-per-batch", min=1,
    help="Prompt groups per trainer batch: in step batching batch k holds group indices [k*G, (k+1)*G) "
         f"(default {_BATCHING_DEFAULTS['groups_per_batch'].default}; ROLLOUT_BUS_GROUPS_PER_BATCH).")
BATCHING = typer.Option(
    None, "--batching",
    help="step: batch k = groups [k*G, (k+1)*G), replayable; arrival: the first G groups to complete "
         f"(default {_BATCHING_DEFAULTS['batching'].default}; ROLLOUT_BUS_BATCHING).")
MAX_STALENESS = typer.Option(
    None, "--max-staleness", min=0, metavar="K",
    help="The run's staleness bound (step batching): the generator starts a group of batch k only once the "
         "live weight version is >= k - K; the shard writer drops an older episode from batch k to the DLQ "
         "(kind stale) (default: no bound; ROLLOUT_BUS_MAX_STALENESS).")
