"""``rollout-bus kafka start|stop|status``: the project's own single-node Kafka on 127.0.0.1."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.errors import BrokerError
from rollout_bus.kafka.local_broker import LocalBroker

app = typer.Typer(help="Run a real single-node Apache Kafka (KRaft) on 127.0.0.1.", no_args_is_help=True)
console = Console(stderr=True)


def _broker(port: int, data_dir: Path | None) -> LocalBroker:
    return LocalBroker(port=port, data_dir=data_dir)


@app.command()
def start(port: int = options.PORT, data_dir: Path | None = options.DATA_DIR,
          timeout: float = typer.Option(90.0, help="Seconds to wait for the broker to answer.")) -> None:
    """Start the broker (fetching its jars once) and wait until it serves metadata; print the bootstrap address."""
    began = time.monotonic()
    try:
        status = _broker(port, data_dir).start(timeout_s=timeout, echo=lambda m: console.print(f"[dim]{m}[/dim]"))
    except BrokerError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print(f"kafka {status.detail} in {time.monotonic() - began:.1f}s; data in {status.data_dir}")
    print(status.bootstrap)


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
