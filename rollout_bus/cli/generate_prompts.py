"""``rollout-bus generate --from-prompts``: one member of the elastic generator group on rollout.prompts.

Thin, as ``generate`` is: the member itself is ``rollout_bus.producers.prompt_member`` (wired with the publisher
and flow records in ``rollout_bus.producers.generator_run.run_prompt_generator``); the episodes come from the
seeded engine on each prompt record (``rollout_bus.sim.prompted``, ``--engine sim``) or a real one
(``rollout_bus.producers.http_prompt_engine``, ``--engine http --engine-url URL``: SGLang's ``/generate`` with
its supports, multi-turn through ``--env module:factory``), scored by ``--reward-fn module:function`` when given.
The plug-ins are loaded before the member joins the group: a bad path, or ``--engine http`` without
``--engine-url``, is one line and exit 2, nothing consumed. Here: the progress line (prompt groups done),
SIGTERM/SIGINT as a clean stop (what is in flight finishes within ``--drain-s`` or is handed back to the group;
exit 128 + the signal), and the summary with the run's prompt ledger (loaded, done, failed, in flight,
redelivered) read back from rollout.prompt_ledger.
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from rollout_bus.cli import options
from rollout_bus.config import GenerateSettings, KafkaSettings
from rollout_bus.errors import ConfigError, RolloutBusError

if TYPE_CHECKING:
    from rollout_bus.producers.prompt_member import MakeTurns, MemberSummary

console = Console(stderr=True)
DEFAULT_RUN_ID = "prompts"  # every member closes the same run: its markers are counted once

# the flags of `rollout-bus generate` that pick and plug the prompt-fed engine
ENGINE_URL = typer.Option(None, "--engine-url", help="--engine http: the SGLang server's (or router's) base URL; "
                          "each turn is one native /generate call with return_sampling_mask.")
ENV = typer.Option(None, "--env", help="--engine http: the environment of multi-turn episodes, module:factory; "
                   "factory(prompt_group, sample_index) gives an object whose step(sample) returns the observation's "
                   "token ids to force next, or None when the episode is done.")
REWARD_FN = typer.Option(None, "--reward-fn", help="--from-prompts: the reward, module:function, called with the "
                         "finished episode's Sample; returns a number or a dict holding it under --reward-key.")
REWARD_KEY = typer.Option(None, "--reward-key", help="--reward-fn returning a dict: the key of the reward in it "
                          "(default 'reward').")


def prompt_engine(settings: GenerateSettings) -> tuple[MakeTurns, bool]:
    """The engine ``--engine`` names, its plug-ins loaded: (make_turns, whether it samples with torch). A bad
    plug-in path is a ``ConfigError``; a missing or misplaced flag is refused (exit 2)."""
    from rollout_bus.producers.plugins import load_env, load_reward

    reward = load_reward(settings.reward_fn, settings.reward_key) if settings.reward_fn else None
    if settings.engine == "http":
        from rollout_bus.producers.groups import parse_adapters
        from rollout_bus.producers.http_prompt_engine import HttpPromptEngine

        if not settings.engine_url:
            options.refuse("--engine http needs --engine-url (the SGLang server or router, e.g. http://host:30000)")
        env = load_env(settings.env_factory) if settings.env_factory else None
        if reward is None:
            console.print("note: no --reward-fn: episodes carry no reward (the trainer leaves them out of its reward "
                          "statistics)")
        sampling = {"temperature": settings.temperature, "top_p": settings.top_p,
                    "top_k": settings.top_k if settings.top_k > 0 else -1, "min_p": settings.min_p,
                    "max_new_tokens": settings.max_response_len}
        slots = {ref.name: ref.slot for ref in parse_adapters(settings.adapters) if ref is not None}
        engine = HttpPromptEngine(settings.engine_url, sampling=sampling, env_factory=env, reward_fn=reward,
                                  max_turns=settings.max_turns, timeout_s=settings.engine_timeout_s,
                                  adapter_slots=slots)
        return engine.turns, False
    if settings.engine != "sim":
        options.refuse(f"--from-prompts drives --engine sim or http (got --engine {settings.engine})")
    if settings.env_factory:
        options.refuse("--env drives --engine http; --engine sim makes its episodes with its own tool environment")
    from rollout_bus.sim.prompted import SimPromptEngine

    return SimPromptEngine(settings, turn_latency_s=settings.turn_latency_ms / 1000, reward_fn=reward).turns, True


def run_from_prompts(settings: GenerateSettings, kafka: KafkaSettings, stop_signals, summary_out: Path | None) -> None:
    """Join the group, take prompt groups until the run is over or a signal; print the summary and ledger."""
    from rollout_bus.kafka.prompt_ledger import read_ledger
    from rollout_bus.producers.generator_run import GeneratorHooks, GeneratorOptions, prepare_run, run_prompt_generator
    from rollout_bus.producers.prompt_member import MemberOptions

    kwargs, topics = kafka.client_kwargs(), kafka.topics()
    generator_id = settings.generator_id()
    run = options.plain_values(GeneratorOptions, settings, generator_id=generator_id,
                               run_batching=settings.run_batching(), max_record_bytes=kafka.max_record_bytes)
    member = MemberOptions(generator_id=generator_id, run_id=settings.run_id or DEFAULT_RUN_ID,
                           concurrency=settings.concurrency, max_deliveries=settings.max_deliveries)
    try:
        make_turns, uses_torch = prompt_engine(settings)  # before anything is created or consumed
        prepare_run(kwargs, topics, run)
        with stop_signals.installed(), _threads(settings.torch_threads if uses_torch else None), Progress(
                TextColumn("generate (prompts)"), TextColumn("{task.fields[line]}"), TimeElapsedColumn(),
                console=console, transient=False) as progress:
            task = progress.add_task("prompts", line="joining the generators' group")

            def update(s: MemberSummary) -> None:
                progress.update(task, line=f"{s.done} prompt groups done ({len(s.episodes)} episodes, {s.turns_sent} "
                                           f"turns), {s.redelivered} redelivered, {s.failed} failed")

            summary, seconds = run_prompt_generator(kwargs, topics, run, member, make_turns,
                                                    hooks=GeneratorHooks(stop=stop_signals.requested),
                                                    on_prompt_group=update)
        ledger = read_ledger(kwargs, topics).counts()
    except ConfigError as exc:
        options.say_error(exc, "generator refused")
        raise typer.Exit(2) from exc
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    if summary_out is not None:
        summary_out.write_text(json.dumps({**summary.to_json(), "generator": generator_id, "ledger": ledger}, indent=1))
    console.print(f"generator {generator_id}: {summary.done} prompt groups done, {summary.failed} failed, "
                  f"{summary.handed_back} handed back, {summary.passed_over} passed over; {len(summary.episodes)} "
                  f"episodes, {summary.turns_sent} turns in {seconds:.1f}s")
    console.print("prompt ledger: " + ", ".join(f"{name.replace('_', ' ')} {count}" for name, count in ledger.items()))
    if summary.closed_run:
        console.print(f"run {member.run_id}: closed (every loaded prompt group is done or failed)")
    if stop_signals.signum is not None:
        console.print(f"stopped ({signal.Signals(stop_signals.signum).name}): what was in flight finished or was "
                      "handed back to the group")
        raise typer.Exit(128 + stop_signals.signum)


def _threads(count: int | None):
    """torch's threads for an engine that samples with torch (``count``); nothing for one that does not."""
    if count is None:
        return contextlib.nullcontext()
    from rollout_bus.producers.torch_threads import torch_threads

    return torch_threads(count)
