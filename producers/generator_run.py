"""One generator's run against the cluster, wired: what every generator needs around the turns it makes.

Why here: a generator (the simulated one, the real policy's) only makes turns; the run around them is the
same for every engine and belongs to the producers stage, so the CLI only reads flags and settings, shows
progress and maps exit codes. The stage gets plain values (``GeneratorOptions``), never the settings.

Contract:

* ``prepare_run(client_kwargs, topics, options)`` waits for the cluster (a generator started during an
  outage waits it out, up to ``delivery_timeout_s``, saying so), creates missing topics, and with a
  staleness bound holds the run to one batching: it declares ``options.run_batching`` on rollout.run, or
  checks the run's (``ConfigError`` naming the setting, before any turn is sent: the gate counts batches).
* ``run_generator(client_kwargs, topics, options, publish, *, open_watcher, hooks)`` then runs it: follows
  the trainer's weights when ``options.follows`` (``open_watcher(client_kwargs, topics, initial=
  policy_version)``, the ``WeightWatcher`` of ``rollout_bus.consumers.feed.weights``: handed in, since no
  stage imports another; and the ``StalenessGate`` on ``options.run_batching``), opens the
  ``TurnPublisher``, calls ``publish(publisher, watcher, gate, progress)`` (``publish_generated``,
  ``publish_policy_turns``: they make and send the turns), and reports the generator's flow (the gate's
  waits) on rollout.metrics as it goes and once more, final, at the end. It returns the
  ``GenerateSummary`` and the seconds since it began; the watcher and the flow reporter are closed
  whatever happens.
* ``run_prompt_generator(client_kwargs, topics, options, member, make_turns, open_watcher=None, hooks=...)``: the
  same around one member of the generators' group on rollout.prompts (``prompt_member.run_member``), stopped by
  ``hooks.stop``; with a staleness bound the member holds back the prompt groups the gate does not admit yet
  (its flow's gate keys: the time a worker slot was free while one was held, and how many were).
* ``GeneratorHooks`` is what the caller is told (each optional): ``progress`` after every turn and once at
  the end, ``broker_wait`` and ``gate_wait`` while the publisher waits for the broker or the gate for the
  trainer (``None`` once it is over), ``following(live)`` when it starts following the weights; ``stop()``
  true (a signal) stops the gate at the next group or during a wait (``rollout_bus.errors.Stopped``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rollout_bus.kafka.admin import ensure_topics, wait_for_cluster
from rollout_bus.kafka.flow_reporter import FlowReporter
from rollout_bus.kafka.run_record import check_run_batching, declared_by
from rollout_bus.producers.broker_wait import WaitFn
from rollout_bus.producers.prompt_member import MakeTurns, MemberOptions, MemberSummary, run_member
from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.producers.run import GenerateSummary, ProgressFn
from rollout_bus.producers.staleness_gate import GateWaitFn, StalenessGate
from rollout_bus.wire.flow_metrics import STAGE_GENERATOR, generator_flow
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.topics import Topics

# publish(publisher, watcher or None, gate or None, progress) -> what was sent
Publish = Callable[[TurnPublisher, Any, StalenessGate | None, ProgressFn], GenerateSummary]
OpenWatcher = Callable[..., Any]  # (client_kwargs, topics, *, initial) -> a WeightWatcher


@dataclass(frozen=True)
class GeneratorOptions:
    """The plain values a generator's run is wired from (the CLI builds them from ``GenerateSettings``)."""

    generator_id: str  # the ``generator`` header of its turns and the source of its flow records
    run_batching: RunBatching  # with ``max_staleness``, the bound the gate holds its groups to
    follow_weights: bool  # stamp engine calls with the trainer's live version (a bound implies it)
    policy_version: int  # the version engine calls carry until the trainer publishes one
    delivery_timeout_s: float  # how long a record (and a start) may wait for an unreachable broker
    max_record_bytes: int

    @property
    def follows(self) -> bool:
        return self.follow_weights or self.run_batching.max_staleness is not None


@dataclass(frozen=True)
class GeneratorHooks:
    """What the caller is told as the run goes, and how it asks for a stop (see the module docstring)."""

    progress: ProgressFn | None = None
    broker_wait: WaitFn | None = None
    gate_wait: GateWaitFn | None = None
    following: Callable[[int], None] | None = None
    stop: Callable[[], bool] | None = None


def prepare_run(client_kwargs: Mapping[str, Any], topics: Topics, options: GeneratorOptions) -> None:
    """The cluster reached, the topics there, the run's batching held (see the module docstring)."""
    kwargs = dict(client_kwargs)
    wait_for_cluster(kwargs, options.delivery_timeout_s)
    ensure_topics(kwargs, topics, max_record_bytes=options.max_record_bytes)
    if options.run_batching.max_staleness is not None:  # the gate counts batches: hold them to the run's batching
        check_run_batching(kwargs, topics, replace(options.run_batching, declared_by=declared_by("generator")))


def run_generator(client_kwargs: Mapping[str, Any], topics: Topics, options: GeneratorOptions, publish: Publish, *,
                  open_watcher: OpenWatcher, hooks: GeneratorHooks = GeneratorHooks()
                  ) -> tuple[GenerateSummary, float]:
    """Follow the weights, publish every turn, report the flow; (summary, seconds) (see the module docstring)."""
    kwargs = dict(client_kwargs)
    began = time.monotonic()
    watcher = open_watcher(kwargs, topics, initial=options.policy_version) if options.follows else None
    flow = FlowReporter(kwargs, topics, STAGE_GENERATOR, options.generator_id)

    def progress(summary: GenerateSummary) -> None:
        if hooks.progress is not None:
            hooks.progress(summary)
        flow.report(generator_flow(summary.weight_waited_s, summary.weight_waits, flow.elapsed_s))

    try:
        gate = _gate(watcher, options.run_batching, hooks)
        bootstrap = kwargs.pop("bootstrap_servers")
        with TurnPublisher(bootstrap, topic=topics.turns, max_record_bytes=options.max_record_bytes,
                           delivery_timeout_s=options.delivery_timeout_s, on_wait=hooks.broker_wait,
                           generator=options.generator_id, **kwargs) as publisher:
            summary = publish(publisher, watcher, gate, progress)
        progress(summary)
        flow.report(generator_flow(summary.weight_waited_s, summary.weight_waits, flow.elapsed_s), final=True)
    finally:
        flow.close()
        if watcher is not None:
            watcher.close()
    return summary, time.monotonic() - began


def run_prompt_generator(client_kwargs: Mapping[str, Any], topics: Topics, options: GeneratorOptions,
                         member: MemberOptions, make_turns: MakeTurns, *, open_watcher: OpenWatcher | None = None,
                         hooks: GeneratorHooks = GeneratorHooks(),
                         on_prompt_group: Callable[[MemberSummary], None] | None = None) -> tuple[MemberSummary, float]:
    """One member of the generators' group on rollout.prompts (``rollout_bus.producers.prompt_member``), with the
    publisher and the flow records every generator has, and with a staleness bound its gate (on a watcher of its
    own, ``open_watcher``: the member's loop asks it, never the engine's threads); (summary, seconds)."""
    kwargs = dict(client_kwargs)
    began = time.monotonic()
    follows = options.run_batching.max_staleness is not None and open_watcher is not None
    watcher = open_watcher(kwargs, topics, initial=options.policy_version) if follows else None
    flow = FlowReporter(kwargs, topics, STAGE_GENERATOR, options.generator_id)

    def progress(summary: MemberSummary) -> None:
        if on_prompt_group is not None:
            on_prompt_group(summary)
        flow.report(generator_flow(summary.gate_held_s, summary.gate_waits, flow.elapsed_s, summary.resume_counts()))

    try:
        gate = _gate(watcher, options.run_batching, hooks)
        bootstrap = kwargs.pop("bootstrap_servers")
        with TurnPublisher(bootstrap, topic=topics.turns, max_record_bytes=options.max_record_bytes,
                           delivery_timeout_s=options.delivery_timeout_s, on_wait=hooks.broker_wait,
                           generator=options.generator_id, **kwargs) as publisher:
            summary = run_member(client_kwargs, topics, member, make_turns, publisher,
                                 stop=hooks.stop or (lambda: False), progress=progress, gate=gate)
        flow.report(generator_flow(summary.gate_held_s, summary.gate_waits, flow.elapsed_s, summary.resume_counts()),
                    final=True)
    finally:
        flow.close()
        if watcher is not None:
            watcher.close()
    return summary, time.monotonic() - began


def _gate(watcher: Any, run: RunBatching, hooks: GeneratorHooks) -> StalenessGate | None:
    """The staleness gate on the watcher (None without one), and the live version it starts from, told."""
    if watcher is None:
        return None
    gate = StalenessGate(watcher, run, on_wait=hooks.gate_wait, stop=hooks.stop)
    live = gate.current()
    if hooks.following is not None:
        hooks.following(live)
    return gate
