"""The ``rollout-bus`` command: one entry point, one module per subcommand.

typer gives typed flags with ``--help`` generated from the signatures (and is click underneath, so
every stage stays scriptable); rich draws the progress bars and tables a person watches.
"""

from __future__ import annotations


import typer

from rollout_bus.cli import options
from rollout_bus.cli import (acl, demo, end_run, exporter, generate, inspect, kafka, prompts, publish_from_engine,
                             replay, report, shards, stream, tail, topics, train)

app = typer.Typer(
    name="rollout-bus",
    help="Apache Kafka transport for LLM RL rollouts: per-turn samples in, data-parallel trainer shards out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(kafka.app, name="kafka")
app.add_typer(topics.app, name="topics")
app.add_typer(acl.app, name="acl")
app.add_typer(prompts.app, name="prompts")
app.command("demo")(demo.demo)
app.command("generate")(generate.generate)
app.command("end-run")(end_run.end_run)
app.command("publish-from-engine")(publish_from_engine.publish_from_engine)
app.command("stream")(stream.stream)
app.command("shards")(shards.shards)
app.command("tail")(tail.tail)
app.command("exporter")(exporter.exporter)
app.command("report")(report.report)
app.command("replay")(replay.replay)
app.command("inspect")(inspect.inspect)
app.command("train")(train.train)
app.command("train-sim")(train.train_sim)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level.")) -> None:
    """Only the CLI configures logging: stable key=value fields on stderr."""
    options.configure_logging(verbose)


if __name__ == "__main__":  # python -m rollout_bus.cli.main
    app()
