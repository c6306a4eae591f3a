"""``rollout-bus publish-from-engine``: one SGLang ``/generate`` call on given token ids, published as a turn.

Thin: parse, check the sampling params (``publish.engine_request``), call the engine with
``return_sampling_mask`` (``publish.engine_client``), read its answer (``publish.engine_adapter``), publish it
on rollout.turns. It prints the turn (tokens, support sizes, status) and exits 0 once the broker has it; any
refusal (a request the trainer could not replay, the engine's error, an answer that breaks the contract, no
engine) is one line and exit 1, nothing published. Also ``python -m rollout_bus.cli.publish_from_engine``.
"""

from __future__ import annotations

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import RolloutBusError
from rollout_bus.model.sample import Sample

console = Console(stderr=True)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise typer.BadParameter(f"--input-ids must be comma-separated token ids (got {text!r})") from exc
    if not ids:
        raise typer.BadParameter("--input-ids must name at least one token id")
    return ids


def publish_from_engine(
    engine_url: str = typer.Option(..., "--engine-url", help="The engine's base URL (SGLang server or router)."),
    input_ids: str = typer.Option(..., "--input-ids", help="The context as comma-separated token ids."),
    group_index: int = typer.Option(..., "--group-index", min=0, help="The prompt group of the episode."),
    rollout_id: int = typer.Option(..., "--rollout-id", min=0, help="The episode's id within its group."),
    group_size: int = typer.Option(..., "--group-size", min=1, help="Episodes in the group."),
    turn: int = typer.Option(0, "--turn", min=0, help="This turn's number within the attempt."),
    final: bool = typer.Option(True, "--final/--not-final", help="Whether this turn ends the episode."),
    attempt: int = typer.Option(0, "--attempt", min=0, help="The attempt (a retried episode counts up)."),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(-1, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=0),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds to wait for the engine."),
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Ask the engine for one turn with its sampling supports and publish it to rollout.turns."""
    from rollout_bus.producers.engine_client import EngineClient
    from rollout_bus.producers.engine_client import publish_from_engine as publish
    from rollout_bus.producers.publisher import TurnPublisher

    options.configure_logging(verbose)
    context = _ids(input_ids)
    params = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "max_new_tokens": max_new_tokens}
    template = Sample(group_index=group_index, index=rollout_id, rollout_id=rollout_id)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    kwargs = kafka.client_kwargs()
    bootstrap = kwargs.pop("bootstrap_servers")
    try:
        with TurnPublisher(bootstrap, topic=kafka.topics().turns, max_record_bytes=kafka.max_record_bytes,
                           delivery_timeout_s=GenerateSettings().delivery_timeout_s, **kwargs) as publisher:
            sample = publish(EngineClient(engine_url, timeout_s=timeout), publisher, template=template,
                             context_tokens=context, sampling_params=params, turn=turn, final=final,
                             group_size=group_size, attempt=attempt)
            publisher.flush()
    except (RolloutBusError, ValueError) as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    mask = sample.rollout_sampling_mask
    sizes = [] if mask is None else [int(mask.row(t).size) for t in range(sample.response_length)]
    console.print(f"published turn {turn} of group {group_index} rollout {rollout_id} to {kafka.topics().turns}: "
                  f"{sample.response_length} tokens {[int(t) for t in sample.tokens[len(context):]]}, supports of "
                  f"{sizes} ids, status {sample.status.value}", markup=False)


if __name__ == "__main__":  # python -m rollout_bus.cli.publish_from_engine
    typer.run(publish_from_engine)
