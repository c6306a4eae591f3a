"""``rollout-bus kafka start|stop|status``: the project's own single-node Kafka on 127.0.0.1; ``kafka tool``:
Kafka's own command-line tools from the same jars, against any cluster."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.errors import BrokerError, ConfigError
from rollout_bus.local_kafka.compose_secrets import COMPOSE_HOSTS, ComposeSecrets
from rollout_bus.local_kafka.local_broker import LocalBroker
from rollout_bus.local_kafka.runtime import classpath, ensure_jars, java_executable

app = typer.Typer(help="Run a real single-node Apache Kafka (KRaft) on 127.0.0.1, and Kafka's own tools.",
                  no_args_is_help=True)
console = Console(stderr=True)


def _broker(port: int, data_dir: Path | None, secure: bool = False) -> LocalBroker:
    return LocalBroker(port=port, data_dir=data_dir, secure=secure)


@app.command()
def start(port: int = options.PORT, data_dir: Path | None = options.DATA_DIR,
          timeout: float = typer.Option(90.0, help="Seconds to wait for the broker to answer."),
          secure: bool = typer.Option(False, "--secure", help="TLS and SCRAM-SHA-512 on the client listener, ACLs "
                                      "enforced (nothing allowed without one), a principal per role with its ACLs; "
                                      "on a new --data-dir only (its principals are made when it is formatted).")
          ) -> None:
    """Start the broker (fetching its jars once) and wait until it serves metadata; print the bootstrap address."""
    began = time.monotonic()
    try:
        broker = _broker(port, data_dir, secure)
        status = broker.start(timeout_s=timeout, echo=lambda m: console.print(f"[dim]{m}[/dim]"))
    except (BrokerError, ConfigError) as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    console.print(f"kafka {status.detail} in {time.monotonic() - began:.1f}s; data in {status.data_dir}")
    if broker.secure is not None:
        _say_secure(broker)
    print(status.bootstrap)


def _say_secure(broker: LocalBroker) -> None:
    """Where a client of the secured broker finds its settings (never the passwords themselves)."""
    setup = broker.secure
    console.print(f"secured: SASL_SSL, SCRAM-SHA-512, CA {setup.ca_file}; ACLs enforced. One principal per role, "
                  f"its settings in a file to source (`set -a; . FILE; set +a`), its password in a file beside:")
    for user in setup.users():
        console.print(f"  {user:<10} {setup.env_file(user)}")
    console.print(f"Kafka's own tools as admin: --command-config {setup.tools_properties}")


@app.command()
def secrets(directory: Path = typer.Option(Path("compose/secrets"), "--dir", help="Where to write them (kept out "
                                           "of git; compose reads ROLLOUT_BUS_SECRETS_DIR, default compose/secrets)."),
            hosts: list[str] = typer.Option(list(COMPOSE_HOSTS), "--host", help="A name the broker certificate "
                                            "holds (clients check the one they dial); repeat for each.")) -> None:
    """Make the CA, broker certificate and one password per principal for the secured compose stack
    (compose/docker-compose.secure.yml); print the files, never their contents."""
    try:
        written = ComposeSecrets(directory.resolve()).prepare(java_executable(), hosts)
    except (BrokerError, OSError) as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    console.print(f"compose secrets in {directory.resolve()} (certificate for {', '.join(hosts)}): "
                  f"{len(written)} files; export ROLLOUT_BUS_SECRETS_DIR={directory.resolve()}")
    for path in written:
        print(path)


@app.command()
def stop(port: int = options.PORT, data_dir: Path | None = options.DATA_DIR) -> None:
    """Stop the broker this tool started (by its recorded pid); nothing else is touched."""
    stopped = _broker(port, data_dir).stop()
    console.print("kafka stopped" if stopped else "kafka was not running")


@app.command()
def status(port: int = options.PORT, data_dir: Path | None = options.DATA_DIR) -> None:
    """Print up or down; exit 0 when up, 3 when down."""
    state = _broker(port, data_dir).status()
    print(f"{'up' if state.up else 'down'} {state.bootstrap} ({state.detail})")
    raise typer.Exit(0 if state.up else 3)


# The scripts of Kafka's bin/ directory, by their names there (kafka-console-consumer.sh -> console-consumer).
KAFKA_TOOLS = {
    "console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "console-producer": "org.apache.kafka.tools.ConsoleProducer",
    "consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "topics": "org.apache.kafka.tools.TopicCommand",
    "get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "configs": "kafka.admin.ConfigCommand",                   # e.g. a topic's min.insync.replicas, and where it is set
    "metadata-quorum": "org.apache.kafka.tools.MetadataQuorumCommand",  # the KRaft voters and their lag
    "acls": "org.apache.kafka.tools.AclCommand",                # a secured cluster's ACLs (--list)
}


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def tool(ctx: typer.Context, name: str = typer.Argument(..., help=f"One of: {', '.join(KAFKA_TOOLS)}.")) -> None:
    """Run one of Kafka's own tools (the kafka-NAME.sh of its bin/) from the project's jars; every further
    argument goes to the tool, e.g. `rollout-bus kafka tool consumer-groups --bootstrap-server
    127.0.0.1:9092 --describe --all-groups`."""
    main_class = KAFKA_TOOLS.get(name)
    if main_class is None:
        options.say_error(f"no Kafka tool {name!r}; choose one of {', '.join(KAFKA_TOOLS)}")
        raise typer.Exit(2)
    try:
        java, libs = java_executable(), ensure_jars(echo=lambda m: console.print(f"[dim]{m}[/dim]"))
    except BrokerError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    os.execv(java, [java, "-Xmx512m", "-cp", classpath(libs), main_class, *ctx.args])
