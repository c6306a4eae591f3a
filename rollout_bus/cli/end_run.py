"""``rollout-bus end-run --run-id X``: close a run by hand; thin: parse, settle, send.

For runs whose generators were started with ``--no-end-of-run`` (several generators sharing one
run): once every one of them has exited 0, the operator closes the run with this, so the shard
writer writes the run's last, partial batch. It sends the same records ``generate`` sends at its
end (``TurnPublisher.publish_end_of_run``): one end-of-run record on every partition of
rollout.turns, and exits 0 once the broker has acknowledged them all. Sending it twice is
harmless (the shard writer has already closed the run). A cluster that does not answer is said in one
line within seconds (exit 1), before anything is sent. Also ``python -m rollout_bus.cli.end_run``.
"""

from __future__ import annotations

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import RolloutBusError
from rollout_bus.kafka.admin import existing_topics

console = Console(stderr=True)


def end_run(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    run_id: str = typer.Option(..., "--run-id", help="The run to close (the generators' --run-id)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Send an end-of-run record for RUN_ID to every rollout.turns partition (once all its generators exited)."""
    from rollout_bus.producers.publisher import TurnPublisher

    options.configure_logging(verbose)
    if not run_id.strip():
        raise typer.BadParameter("--run-id must name a run (got an empty string)")
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    kwargs = kafka.client_kwargs()
    bootstrap = kwargs.pop("bootstrap_servers")
    topic = kafka.topics().turns
    options.cluster_answers(kafka.client_kwargs())  # a closed port is said at once, in one line
    try:
        if not existing_topics({**kwargs, "bootstrap_servers": bootstrap}, [topic]):
            options.say_error(f"topic {topic} does not exist at {bootstrap} (check --topic-prefix)")
            raise typer.Exit(1)
        with TurnPublisher(bootstrap, topic=topic, max_record_bytes=kafka.max_record_bytes,
                           delivery_timeout_s=GenerateSettings().delivery_timeout_s, **kwargs) as publisher:
            partitions = publisher.publish_end_of_run(run_id)
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    console.print(f"run {run_id} closed on {partitions} partitions of {topic}")


if __name__ == "__main__":  # python -m rollout_bus.cli.end_run
    typer.run(end_run)
