"""``rollout-bus generate --from-prompts``: one member of the elastic generator group on rollout.prompts.

Thin, as ``generate`` is: the member itself is ``rollout_bus.producers.prompt_member`` (wired with the publisher
and flow records in ``rollout_bus.producers.generator_run.run_prompt_generator``); the episodes come from the
seeded engine on each prompt record (``rollout_bus.sim.prompted``, ``--engine sim``), the real policy
(``rollout_bus.learn.prompted``, ``--engine policy``: the calculator task's environment and reward unless
``--env``/``--reward-fn`` say otherwise; with ``--max-staleness`` or ``--follow-weights`` it loads every version
the trainer publishes, after waiting for the first) or a real engine (``rollout_bus.producers.http_prompt_engine``,
``--engine http --engine-url URL``: SGLang's ``/generate`` with its supports, multi-turn through ``--env
module:factory``), scored by ``--reward-fn module:function`` when given. With ``--max-staleness`` the member
holds back the prompt groups whose batch may not start yet (``producers.prompt_member``).
The plug-ins are loaded before the member joins the group: a bad path, or ``--engine http`` without
``--engine-url``, is one line and exit 2, nothing consumed. Here: the progress line (prompt groups done),
SIGTERM/SIGINT as a clean stop (what is in flight finishes within ``--drain-s`` or is handed back to the group;
exit 128 + the signal), and the summary with the run's prompt ledger (loaded, done, failed, in flight,
redelivered) read back from rollout.prompt_ledger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import typer
from rich.console import Console
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from rollout_bus.cli import options
from rollout_bus.config import GenerateSettings, KafkaSettings
from rollout_bus.errors import EXIT_NO_USABLE_WEIGHTS, ConfigError, NoUsableWeights, RolloutBusError, Stopped

if TYPE_CHECKING:
    from rollout_bus.producers.prompt_member import MakeTurns, MemberSummary

console = Console(stderr=True)
DEFAULT_RUN_ID = "prompts"  # every member closes the same run: its markers are counted once

# the flags of `rollout-bus generate` that pick and plug the prompt-fed engine
ENGINE_URL = typer.Option(None, "--engine-url", help="--engine http: the SGLang server's (or router's) base URL; "
                          "each turn is one native /generate call with return_sampling_mask. Give it more than "
                          "once (or comma-separated) for a pool: a call to an engine that dies goes to another; "
                          "a 4xx is not retried.")
ENV = typer.Option(None, "--env", help="--engine http or policy: the environment of multi-turn episodes, "
                   "module:factory; "
                   "factory(prompt_group, sample_index) gives an object whose step(sample) returns the observation's "
                   "token ids to force next, or None when the episode is done.")
REWARD_FN = typer.Option(None, "--reward-fn", help="--from-prompts: the reward, module:function, called with the "
                         "finished episode's Sample; returns a number or a dict holding it under --reward-key.")
REWARD_KEY = typer.Option(None, "--reward-key", help="--reward-fn returning a dict: the key of the reward in it "
                          "(default 'reward').")


CALCULATOR_ENV, CALCULATOR_REWARD = "rollout_bus.learn.task:calculator_env", "rollout_bus.learn.task:calculator_reward"


class PolicyOnPrompts:
    """``--engine policy`` on prompt records: the policy engine, following the trainer's weights on a watcher of
    its own when asked (``start`` waits for the first verified checkpoint), and its plug-ins."""

    def __init__(self, settings: GenerateSettings, kafka: KafkaSettings) -> None:
        from rollout_bus.learn.engine import PolicyEngine
        from rollout_bus.learn.prompted import PolicyPromptEngine
        from rollout_bus.policy.sampler import Sampler
        from rollout_bus.producers.plugins import load_env, load_reward

        if settings.inject_faults:
            options.refuse("--inject-faults is the seeded engine's; --engine policy makes no deliberate faults")
        env = load_env(settings.env_factory or CALCULATOR_ENV)
        reward = load_reward(settings.reward_fn or CALCULATOR_REWARD, settings.reward_key)
        self.settings, self.kafka, self.watcher = settings, kafka, None
        sampler = Sampler(settings.temperature, settings.top_p, settings.top_k, settings.min_p)
        self.engine = PolicyEngine(settings.seed, sampler, version=settings.policy_version, live=self._live)
        self.prompted = PolicyPromptEngine(settings, self.engine, env=env, reward=reward)

    def _live(self):
        if self.watcher is None:
            return None
        self.watcher.refresh()
        return self.watcher.latest

    def start(self, stop) -> None:
        """Following the trainer: open the engine's watcher and wait for its first published checkpoint."""
        if not (self.settings.follow_weights or self.settings.max_staleness is not None):
            return
        from rollout_bus.consumers.feed.weights import WeightWatcher
        from rollout_bus.learn.generator import wait_for_first_weights

        self.watcher = WeightWatcher(self.kafka.client_kwargs(), self.kafka.topics())
        wait_for_first_weights(self.engine, lambda ms: self.watcher.refresh(timeout_ms=ms), stop=stop,
                               give_up_s=self.settings.weights_wait_s or None)

    def versions(self, *_args, **_kwargs) -> "EngineVersions":
        """What the member's staleness gate counts: the version the engine runs (as ``LoadedVersions`` does for
        the built-in generator), so a group admitted under version v is generated under v or later."""
        return EngineVersions(self.prompted)

    def close(self) -> None:
        logging.getLogger("rollout_bus.learn.generator").info(
            "policy engine loaded %d weight versions, refused %d", self.engine.loads, len(self.engine.refused))
        if self.watcher is not None:
            self.watcher.close()


class EngineVersions:
    """The gate's view of the policy engine: ``version`` it runs, ``refresh()`` loading what the trainer published
    (between two engine calls: the worker threads' lock), ``close()`` nothing (the engine's watcher is its own)."""

    def __init__(self, prompted) -> None:
        self.prompted = prompted

    @property
    def version(self) -> int:
        return self.prompted.engine.version

    def refresh(self, timeout_ms: int = 0) -> int:
        with self.prompted.lock:
            return self.prompted.engine.refresh()

    def close(self) -> None:
        pass


class PromptEngine(NamedTuple):
    """The engine ``--engine`` names: its ``make_turns``, whether it samples with torch, and what must start
    before the member joins and close after (the policy's weights)."""

    make_turns: MakeTurns
    uses_torch: bool
    start: Callable[[Callable[[], bool]], None] = lambda _stop: None
    close: Callable[[], None] = lambda: None
    versions: Callable[..., object] | None = None  # the staleness gate's version source, if not rollout.weights


def prompt_engine(settings: GenerateSettings, kafka: KafkaSettings | None = None) -> PromptEngine:
    """The engine ``--engine`` names, its plug-ins loaded. A bad plug-in path is a ``ConfigError``; a missing or
    misplaced flag is refused (exit 2)."""
    from rollout_bus.producers.plugins import load_env, load_reward

    if settings.engine == "policy":
        policy = PolicyOnPrompts(settings, kafka if kafka is not None else KafkaSettings())
        return PromptEngine(policy.prompted.turns, True, policy.start, policy.close, policy.versions)

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
        return PromptEngine(engine.turns, False)
    if settings.env_factory:
        options.refuse("--env drives --engine http or policy; --engine sim makes its episodes with its own tool "
                       "environment")
    from rollout_bus.sim.prompted import SimPromptEngine

    return PromptEngine(SimPromptEngine(settings, turn_latency_s=settings.turn_latency_ms / 1000,
                                        reward_fn=reward).turns, True)


def run_from_prompts(settings: GenerateSettings, kafka: KafkaSettings, stop_signals, summary_out: Path | None) -> None:
    """Join the group, take prompt groups until the run is over or a signal; print the summary and ledger."""
    from rollout_bus.consumers.feed.weights import WeightWatcher
    from rollout_bus.kafka.prompt_ledger import read_ledger
    from rollout_bus.producers.generator_run import GeneratorHooks, GeneratorOptions, prepare_run, run_prompt_generator
    from rollout_bus.producers.prompt_member import MemberOptions

    kwargs, topics = kafka.client_kwargs(), kafka.topics()
    generator_id = settings.generator_id()
    run = options.plain_values(GeneratorOptions, settings, generator_id=generator_id,
                               run_batching=settings.run_batching(), max_record_bytes=kafka.max_record_bytes)
    member = MemberOptions(generator_id=generator_id, run_id=settings.run_id or DEFAULT_RUN_ID,
                           concurrency=settings.concurrency, max_deliveries=settings.max_deliveries,
                           resume=settings.resume)
    engine = None
    try:
        engine = prompt_engine(settings, kafka)  # before anything is created or consumed
        prepare_run(kwargs, topics, run)
        with stop_signals.installed(), _threads(settings.torch_threads if engine.uses_torch else None), Progress(
                TextColumn("generate (prompts)"), TextColumn("{task.fields[line]}"), TimeElapsedColumn(),
                console=console, transient=False) as progress:
            task = progress.add_task("prompts", line="joining the generators' group")
            engine.start(stop_signals.requested)
            held = [""]

            def update(s: MemberSummary) -> None:
                progress.update(task, line=f"{s.done} prompt groups done ({len(s.episodes)} episodes, {s.turns_sent} "
                                           f"turns), {s.redelivered} redelivered, {s.failed} failed{held[0]}")

            def on_gate(wait) -> None:
                held[0] = "" if wait is None else f" [yellow]- {wait.describe()}[/yellow]"

            summary, seconds = run_prompt_generator(
                kwargs, topics, run, member, engine.make_turns, open_watcher=engine.versions or WeightWatcher,
                hooks=GeneratorHooks(stop=stop_signals.requested, gate_wait=on_gate), on_prompt_group=update)
        ledger = read_ledger(kwargs, topics).counts()
    except ConfigError as exc:
        options.say_error(exc, "generator refused")
        raise typer.Exit(2) from exc
    except Stopped as exc:
        options.say_error(exc)
        raise typer.Exit(128 + stop_signals.signum if stop_signals.signum else 1) from exc
    except NoUsableWeights as exc:
        options.say_error(exc)
        raise typer.Exit(EXIT_NO_USABLE_WEIGHTS) from exc
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    finally:
        if engine is not None:
            engine.close()
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
