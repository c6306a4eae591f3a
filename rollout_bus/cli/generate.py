"""``rollout-bus generate``: the built-in generator publishing to rollout.turns.

Thin: it reads flags and settings, builds the plain values the producers stage runs on
(``rollout_bus.producers.generator_run``: the cluster wait, missing topics, the run's batching, the weight
watcher, the staleness gate, the ``TurnPublisher`` and the flow records are wired there), draws the
progress line, turns SIGTERM/SIGINT into a clean stop while it follows the weights, maps errors to exit
codes, and prints and writes the summary; the episodes themselves come from
``rollout_bus.sim.generator.publish_generated`` (``--engine sim``, the default) or
``rollout_bus.learn.generator.publish_policy_turns`` (``--engine policy``: the real policy, which loads
every checkpoint the trainer publishes and, following it, first waits for one).

Also ``python -m rollout_bus.cli.generate``. Progress (turns sent) goes to stderr with rich; the
summary (run id, finished episodes with their attempts, turns, bytes, faults) is printed, and
written as JSON with ``--summary-out``. Exit 0 once every record is acknowledged by the broker and
the run is closed: an end-of-run record on every rollout.turns partition (``--run-id``, default a
fresh uuid hex), so the shard writer writes the last, partial batch. Several generators sharing
one run pass one ``--run-id`` and ``--no-end-of-run``; then one of them (the last to finish, run
without ``--no-end-of-run``), or the operator with ``rollout-bus end-run --run-id``, closes the
run once all are done. A broker outage shorter than ``--delivery-timeout`` (15 min) is ridden
out: records wait in the producer, a WARNING line every 10 s and the progress line say so; a
generator started while the broker is down waits for it as long, with the same WARNING lines (the first at
once for a closed port). A bad ``--topic-prefix`` or a ``--summary-out`` that could not be written is refused in
one line (exit 2) before anything is sent.

The control loop: with ``--follow-weights`` each engine call is stamped with the trainer's live
weight version (read from rollout.weights); with ``--max-staleness K`` (implies following) a group of
batch k (= group index // ``--groups-per-batch``) starts only once that version is >= k - K, and
waits otherwise (an INFO line about every 10 s and the progress line say why). A SIGTERM or SIGINT
then stops the generator at the next group boundary or during the wait: what was sent is flushed,
the run is not closed, and it exits 128 + the signal number (a second signal stops it at once). The
summary names the least and greatest live versions seen. With a bound, the generator first declares
its batching on rollout.run (or checks the run's, as the shard writer does): a mismatch exits 2
naming the setting, before any turn is sent. ``--engine policy`` refuses a published version whose
checkpoint is missing or fails its sha256 by name (``version 3 at file:///...: missing``); with no
verified weights ``--weights-wait-s`` (120) after that, it exits 66 (``EXIT_NO_USABLE_WEIGHTS``) naming them.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollout_bus.cli import options
from rollout_bus.cli.generate_prompts import ENGINE_URL, ENV, REWARD_FN, REWARD_KEY
from rollout_bus.config import GenerateSettings, KafkaSettings
from rollout_bus.errors import EXIT_NO_USABLE_WEIGHTS, ConfigError, NoUsableWeights, RolloutBusError, Stopped
from rollout_bus.consumers.feed.weights import WeightWatcher

if TYPE_CHECKING:
    from rollout_bus.producers.broker_wait import BrokerWait
    from rollout_bus.producers.generator_run import GeneratorHooks, Publish
    from rollout_bus.producers.run import GenerateSummary
    from rollout_bus.producers.staleness_gate import GateWait
    from rollout_bus.wire.topics import Topics

console = Console(stderr=True)
logger = logging.getLogger("rollout_bus.cli.generate")


class StopSignals:
    """SIGTERM/SIGINT ask for a stop (``requested`` turns true, ``signum`` says which); a second one stops
    at once (KeyboardInterrupt)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        logger.info("%s: stopping at the next group boundary or wait (again to stop now)",
                    signal.Signals(signum).name)

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        before = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


def _columns() -> tuple:
    return (TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TextColumn("episodes, {task.fields[turns]} "
            "turns sent, {task.fields[mb]:.1f} MB{task.fields[weights]}{task.fields[note]}{task.fields[gate]}"),
            TimeElapsedColumn())


def _hooks(progress: Progress, settings: GenerateSettings, topics: Topics,
           stop: Callable[[], bool] | None) -> GeneratorHooks:
    """The progress line, kept by what the producers stage tells as the run goes."""
    from rollout_bus.producers.generator_run import GeneratorHooks

    task = progress.add_task("generate", total=settings.episodes, turns=0, mb=0.0, note="", gate="", weights="")

    def update(s: GenerateSummary) -> None:
        weights = "" if s.live_version_max is None else f", weights v{s.live_version_max}"
        progress.update(task, completed=len(s.episodes), turns=s.turns_sent, mb=s.bytes_sent / 1e6, weights=weights)

    def on_wait(wait: BrokerWait | None) -> None:
        note = "" if wait is None else (f" [yellow]- waiting for broker ({wait.waited_s:.0f}s, "
                                        f"{wait.records} records unacknowledged)[/yellow]")
        progress.update(task, note=note)

    def on_gate(wait: GateWait | None) -> None:
        if wait is None:
            progress.update(task, gate="")
            return
        progress.update(task, weights=f", weights v{wait.live}",
                        gate=f" [yellow]- {wait.describe()} ({wait.waited_s:.0f}s)[/yellow]")

    def following(live: int) -> None:
        progress.update(task, weights=f", weights v{live}")
        logger.info("following weights topic=%s live=%d max_staleness=%s groups_per_batch=%d",
                    topics.weights, live, settings.max_staleness, settings.groups_per_batch)

    return GeneratorHooks(progress=update, broker_wait=on_wait, gate_wait=on_gate, following=following, stop=stop)


def _publish(settings: GenerateSettings, stop: Callable[[], bool] | None) -> Publish:
    """Who makes the turns: the simulated generator (``--engine sim``) or the real policy (``--engine policy``)."""
    from rollout_bus.learn.generator import publish_policy_turns  # torch: imported only when generating, so
    from rollout_bus.sim.generator import publish_generated        # the rest of the CLI starts fast

    def publish(publisher, watcher, gate, progress) -> GenerateSummary:
        if settings.engine == "policy":
            return publish_policy_turns(settings, publisher, watcher, progress=progress, gate=gate, stop=stop)
        return publish_generated(settings, publisher, progress=progress, gate=gate)

    return publish


def _run(settings: GenerateSettings, kafka: KafkaSettings,
         stop: Callable[[], bool] | None = None) -> tuple[GenerateSummary, float]:
    from rollout_bus.producers.generator_run import GeneratorOptions, prepare_run, run_generator

    kwargs, topics = kafka.client_kwargs(), kafka.topics()
    run = options.plain_values(GeneratorOptions, settings, generator_id=settings.generator_id(),
                               run_batching=settings.run_batching(), max_record_bytes=kafka.max_record_bytes)
    prepare_run(kwargs, topics, run)
    with Progress(*_columns(), console=console, transient=False) as progress:
        return run_generator(kwargs, topics, run, _publish(settings, stop), open_watcher=WeightWatcher,
                             hooks=_hooks(progress, settings, topics, stop))


def _generate(settings: GenerateSettings, kafka: KafkaSettings) -> tuple[GenerateSummary, float]:
    """Run it; a stop by signal, a refusal or an error becomes its exit code."""
    signals = StopSignals()
    try:
        if settings.follow_weights or settings.max_staleness is not None:
            with signals.installed():
                return _run(settings, kafka, stop=signals.requested)
        return _run(settings, kafka)
    except Stopped as exc:
        if signals.signum is None:  # not ours: a wait for the broker given up
            options.say_error(exc)
            raise typer.Exit(1) from exc
        console.print(f"stopped ({signal.Signals(signals.signum).name}): {exc}; what was sent is flushed, "
                      "the run is left open")
        raise typer.Exit(128 + signals.signum) from exc
    except ConfigError as exc:
        options.say_error(exc, "generator refused")
        raise typer.Exit(2) from exc
    except NoUsableWeights as exc:
        options.say_error(exc)  # one line, whatever the width
        raise typer.Exit(EXIT_NO_USABLE_WEIGHTS) from exc
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc


def _report(summary: GenerateSummary, seconds: float, summary_out: Path | None) -> None:
    """The summary: printed, and written as JSON with ``--summary-out``."""
    if summary_out is not None:
        summary_out.parent.mkdir(parents=True, exist_ok=True)
        partial = summary_out.with_name(summary_out.name + ".partial")
        partial.write_text(json.dumps(summary.to_json(), indent=1))
        partial.replace(summary_out)  # a watcher never reads a half-written summary
    console.print(f"sent {summary.turns_sent} turns of {len(summary.episodes)} episodes, "
                  f"{summary.bytes_sent / 1e6:.2f} MB in {seconds:.1f}s; {len(summary.faults)} deliberate faults")
    closed = (f"closed on {summary.end_of_run_partitions} partitions" if summary.end_of_run_partitions
              else "left open (--no-end-of-run)")
    console.print(f"run {summary.run_id}: {closed}")
    if summary.live_version_max is not None:
        console.print(f"weights: live versions {summary.live_version_min}..{summary.live_version_max}, "
                      f"{summary.weight_waits} wait{'' if summary.weight_waits == 1 else 's'} for the trainer "
                      f"({summary.weight_waited_s:.1f}s)")


def _check_summary_out(summary_out: Path | None) -> None:
    """Refuse, before any topic or record, a ``--summary-out`` that could not be written at the end."""
    if summary_out is not None and summary_out.is_dir():
        options.refuse(f"--summary-out {summary_out} is a directory; give a file name")
    options.writable_dir(None if summary_out is None else summary_out.parent, "--summary-out's directory")


EPISODES = typer.Option(None, "--episodes", help="Episodes in all (groups = ceil(episodes / n)).")
SEED = typer.Option(None, "--seed", help="Seeds everything: the same seed sends the same records.")
N_SAMPLES_PER_PROMPT = typer.Option(None, "--n-samples-per-prompt", help="Episodes per prompt group.")
ADAPTERS = typer.Option(None, "--adapters", help="Comma-separated LoRA adapters, e.g. math,code.")
MAX_TURNS = typer.Option(None, "--max-turns", help="Most turns per episode.")
MIN_RESPONSE_LEN = typer.Option(None, "--min-response-len", help="Fewest tokens per response.")
MAX_RESPONSE_LEN = typer.Option(None, "--max-response-len", help="Most tokens per response.")
VOCAB_SIZE = typer.Option(None, "--vocab-size", help="Vocabulary of the built-in policy.")
TEMPERATURE = typer.Option(None, "--temperature", help="Sampling temperature.")
TOP_P = typer.Option(None, "--top-p", help="Nucleus mass of the sampling support.")
TOP_K = typer.Option(None, "--top-k", help="Most tokens in a support (<= 0: no limit).")
MIN_P = typer.Option(None, "--min-p", help="Drop tokens below this fraction of the most likely one's probability "
                     "(SGLang's min-p; 0: none).")
COMPACTION_PROB = typer.Option(None, "--compaction-prob", help="Chance a turn restarts from a summary.")
RETRY_PROB = typer.Option(None, "--retry-prob", help="Chance an attempt aborts and is retried.")
REMOVE_PROB = typer.Option(None, "--remove-prob", help="Chance an episode is marked remove_sample.")
TOOL_CALL_PROB = typer.Option(None, "--tool-call-prob", help="Chance a response calls the tool.")
TRUNCATION_PROB = typer.Option(None, "--truncation-prob", help="Chance an episode's last turn runs to max length.")
INJECT_FAULTS = typer.Option(False, "--inject-faults", help="Also send a few deliberately bad records.")
RUN_ID = typer.Option(None, "--run-id", help="Names the run in its end-of-run records (default: a fresh uuid hex).")
END_OF_RUN = typer.Option(None, "--end-of-run/--no-end-of-run",
                          help="Close the run when done (default), so the shard writer writes the last, partial "
                               "batch. --no-end-of-run for one of several generators sharing a --run-id: the last "
                               "one, or `rollout-bus end-run`, closes it.")
DELIVERY_TIMEOUT = typer.Option(None, "--delivery-timeout", help="Seconds a record may wait for an unreachable "
                                "broker before the run fails (default 900).")
FOLLOW_WEIGHTS = typer.Option(False, "--follow-weights", help="Stamp each engine call with the trainer's live weight "
                              "version (rollout.weights) instead of the fixed policy version.")
INTERRUPT_PROB = typer.Option(None, "--interrupt-prob", min=0.0, max=1.0,
                              help="Share of turns cut when the live weights change while they are generated: an "
                                   "ABORTED partial turn, then its continuation under the new version (default 0).")
GENERATORS = typer.Option(None, "--generators", min=1,
                          help="How many generators share this run (default 1): with --generator-index each makes "
                               "only its share of the group indices, so none collide.")
GENERATOR_INDEX = typer.Option(None, "--generator-index", min=0,
                               help="This generator's place among --generators (0-based): it makes the groups g with "
                                    "g mod generators == index.")
ENGINE = typer.Option(None, "--engine", help="Who samples: 'sim' (the seeded stand-in, default), 'policy' (the "
                      "real policy on the calculator task, following the trainer's weights when --follow-weights or "
                      "--max-staleness is given) or 'http' (--from-prompts: an SGLang server at --engine-url).")
WEIGHTS_WAIT_S = typer.Option(None, "--weights-wait-s", min=0.0,
                              help="--engine policy following the trainer: seconds to wait, after a published "
                                   "version's checkpoint was refused (missing, or failing its sha256) and with no "
                                   "verified one to generate from, for a newer version before exiting "
                                   f"{EXIT_NO_USABLE_WEIGHTS} (default 120; 0: for ever). A generator with "
                                   "verified weights goes on with them.")
SUMMARY_OUT = typer.Option(None, "--summary-out", help="Write the run summary here as JSON.")
FROM_PROMPTS = typer.Option(False, "--from-prompts", help="Join the elastic generator group: take prompt groups from "
                            "rollout.prompts (`rollout-bus prompts load`) until every loaded one is done or failed, "
                            "then close the run. Start more members at any time; a stopped or killed one's prompt "
                            "groups are taken by the others.")
CONCURRENCY = typer.Option(None, "--concurrency", min=1, help="--from-prompts: prompt groups in flight at once "
                           "(default 4).")
MAX_DELIVERIES = typer.Option(None, "--max-deliveries", min=1, help="--from-prompts: deliveries of a prompt group "
                              "before it is failed and dead-lettered (default 3).")
TURN_LATENCY_MS = typer.Option(None, "--turn-latency-ms", min=0.0, help="--engine sim: the least time one engine "
                               "call takes, as a real engine's would (default 0).")
RESUME = typer.Option(None, "--resume/--no-resume", help="--from-prompts: a prompt group taken over continues its "
                      "episodes from the turns the log holds (default); --no-resume makes every turn again.")
MEMBER_ID = typer.Option(None, "--member-id", help="--from-prompts: this member's generator id (default: host-pid).")


def generate(
    bootstrap_servers: str | None = options.BOOTSTRAP, topic_prefix: str | None = options.TOPIC_PREFIX,
    episodes: int | None = EPISODES, seed: int | None = SEED, n_samples_per_prompt: int | None = N_SAMPLES_PER_PROMPT,
    adapters: str | None = ADAPTERS, max_turns: int | None = MAX_TURNS,
    min_response_len: int | None = MIN_RESPONSE_LEN, max_response_len: int | None = MAX_RESPONSE_LEN,
    vocab_size: int | None = VOCAB_SIZE, temperature: float | None = TEMPERATURE, top_p: float | None = TOP_P,
    top_k: int | None = TOP_K, min_p: float | None = MIN_P, compaction_prob: float | None = COMPACTION_PROB,
    retry_prob: float | None = RETRY_PROB, remove_prob: float | None = REMOVE_PROB,
    tool_call_prob: float | None = TOOL_CALL_PROB, truncation_prob: float | None = TRUNCATION_PROB,
    inject_faults: bool = INJECT_FAULTS, run_id: str | None = RUN_ID, end_of_run: bool | None = END_OF_RUN,
    delivery_timeout: float | None = DELIVERY_TIMEOUT, follow_weights: bool = FOLLOW_WEIGHTS,
    max_staleness: int | None = options.MAX_STALENESS, groups_per_batch: int | None = options.GROUPS_PER_BATCH,
    batching: str | None = options.BATCHING, interrupt_prob: float | None = INTERRUPT_PROB,
    generators: int | None = GENERATORS, generator_index: int | None = GENERATOR_INDEX, engine: str | None = ENGINE,
    weights_wait_s: float | None = WEIGHTS_WAIT_S, summary_out: Path | None = SUMMARY_OUT,
    from_prompts: bool = FROM_PROMPTS, concurrency: int | None = CONCURRENCY,
    max_deliveries: int | None = MAX_DELIVERIES, turn_latency_ms: float | None = TURN_LATENCY_MS,
    member_id: str | None = MEMBER_ID, resume: bool | None = RESUME, engine_url: list[str] | None = ENGINE_URL, env: str | None = ENV,
    reward_fn: str | None = REWARD_FN, reward_key: str | None = REWARD_KEY,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Generate seeded multi-turn rollouts and publish every turn to rollout.turns."""
    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    settings = options.role_settings(
        GenerateSettings, episodes=episodes, seed=seed, n_samples_per_prompt=n_samples_per_prompt,
        adapters=adapters, max_turns=max_turns, min_response_len=min_response_len,
        max_response_len=max_response_len, vocab_size=vocab_size, temperature=temperature, top_p=top_p,
        top_k=top_k, min_p=min_p, compaction_prob=compaction_prob, retry_prob=retry_prob, remove_prob=remove_prob,
        tool_call_prob=tool_call_prob, truncation_prob=truncation_prob, inject_faults=inject_faults or None,
        run_id=run_id, end_of_run=end_of_run, delivery_timeout_s=delivery_timeout,
        follow_weights=follow_weights or None, max_staleness=max_staleness, groups_per_batch=groups_per_batch,
        batching=batching, interrupt_prob=interrupt_prob, engine=engine, generators=generators,
        generator_index=generator_index, weights_wait_s=weights_wait_s, from_prompts=from_prompts or None,
        concurrency=concurrency, max_deliveries=max_deliveries, turn_latency_ms=turn_latency_ms, member_id=member_id,
        resume=resume,
        engine_url=",".join(engine_url) if engine_url else None, env_factory=env, reward_fn=reward_fn, reward_key=reward_key)
    _check_summary_out(summary_out)
    if settings.from_prompts:
        from rollout_bus.cli.generate_prompts import run_from_prompts

        console.print(f"generator member {settings.generator_id()} <- {kafka.topics().prompts}, -> "
                      f"{kafka.topics().turns} at {kafka.client_kwargs()['bootstrap_servers']}")
        run_from_prompts(settings, kafka, StopSignals(), summary_out)
        return
    console.print(f"generator -> {kafka.topics().turns} at {kafka.client_kwargs()['bootstrap_servers']}")
    summary, seconds = _generate(settings, kafka)
    _report(summary, seconds, summary_out)


if __name__ == "__main__":  # python -m rollout_bus.cli.generate
    typer.run(generate)
