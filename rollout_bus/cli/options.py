"""Flags shared by several subcommands, so each means the same thing everywhere, and what they settle.

``kafka_settings`` builds the connection settings from the flags a user set (environment variables
and defaults fill the rest); ``plain_values`` turns a role's settings into the plain values its stage takes
(settings end here: no stage imports ``rollout_bus.config``); ``configure_logging`` is the one logging setup
of every command, also when a stage runs as ``python -m rollout_bus.cli.<stage>``. ``refuse``,
``writable_dir`` and ``cluster_answers`` are the checks every command makes first, before it creates a topic,
writes a record or touches a file: an operator's mistake is one line and exit 2, a cluster that does not answer
one line within seconds.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from pydantic import BaseModel, ValidationError

from rollout_bus.consumers.shard_writer.writer_lock import unwritable
from rollout_bus.errors import BrokerError
from rollout_bus.kafka.admin import require_cluster
from rollout_bus.kafka.client_logs import quiet_client_logs
from rollout_bus.config import DEFAULT_DP_SIZE, BatchingSettings, KafkaSettings

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


def plain_values(cls: type[S], settings: BaseModel, **worked_out: Any) -> S:
    """A stage's plain values (the dataclass ``cls``) from a role's settings: every field of ``cls`` the settings
    have by name, then ``worked_out`` over them (what the CLI derives: a path, a prefixed group, the run's
    batching); the rest keep the stage's defaults. So no field is listed by hand on both sides."""
    names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    shared = {name: getattr(settings, name) for name in type(settings).model_fields if name in names}
    return cls(**{**shared, **worked_out})


def kafka_settings(bootstrap_servers: str | None, topic_prefix: str | None, **more: object) -> KafkaSettings:
    """The connection settings; an unusable one (a prefix Kafka would refuse) is refused in one line naming it."""
    try:
        return KafkaSettings(**given(bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix, **more))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        refuse(problems)


def say_error(problem: object, label: str = "error") -> None:
    """One red line on stderr, unwrapped; the problem printed as text, so a key like ``[null,null,"a",1,2]`` in
    it is not read as markup and dropped."""
    Console(stderr=True).print(f"[red]{label}:[/red] {escape(str(problem))}", soft_wrap=True)


def refuse(problem: str) -> NoReturn:
    """An operator's mistake, found before anything was created or written: one line on stderr, exit 2."""
    typer.echo(f"error: {problem}", err=True)
    raise typer.Exit(2)


def writable_dir(directory: Path | str | None, flag: str) -> None:
    """Refuse (``refuse``) a directory the command would write that is a file, read-only or unreadable
    (``writer_lock.unwritable``, the shard writer's own check), before anything is created or written."""
    problem = None if directory is None or str(directory) == "" else unwritable(directory, flag)
    if problem is not None:
        refuse(problem)


def cluster_answers(client_kwargs: dict[str, Any]) -> None:
    """For a command that does not ride out an outage: exit 1 with one line (the bootstrap and why) unless the
    cluster answers within seconds (``kafka.admin.require_cluster``; a closed port at once)."""
    try:
        require_cluster(client_kwargs)
    except BrokerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


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
DP_SIZE = typer.Option(DEFAULT_DP_SIZE, "--dp-size", min=1,
                       help="Data-parallel ranks: the shard writer writes one shard per rank per batch.")
DP_SIZE_SETTING = typer.Option(  # the shard writer's: unset, ROLLOUT_BUS_DP_SIZE or the default
    None, "--dp-size", min=1,
    help=f"Data-parallel ranks: one shard each per batch (default {DEFAULT_DP_SIZE}; ROLLOUT_BUS_DP_SIZE).")
MAX_STALENESS = typer.Option(
    None, "--max-staleness", min=0, metavar="K",
    help="The run's staleness bound (step batching): the generator starts a group of batch k only once the "
         "live weight version is >= k - K; the shard writer drops an older episode from batch k to the DLQ "
         "(kind stale) (default: no bound; ROLLOUT_BUS_MAX_STALENESS).")
