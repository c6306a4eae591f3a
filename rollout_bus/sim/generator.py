"""The built-in generator: seeded multi-turn episodes, sampled with real top-p/top-k math in torch.

Contract:

* ``iter_turns(settings)`` yields ``(sample, args)`` for every turn, where ``args`` holds the
  ``publish_turn`` keywords ``turn``, ``attempt``, ``final`` and ``group_size``; no Kafka is
  involved. The same settings (seed included) yield the same samples in the same order.
* ``ceil(episodes / n_samples_per_prompt)`` prompt groups (``rollout_bus.producers.groups.plan_groups``), assigned to
  the adapters round-robin.
  ``group_index`` counts the step's prompt groups across adapters (group g goes to adapter g mod A),
  so a step batch's range of group indices is complete from the episodes alone; each adapter numbers
  its own ``index`` (= ``rollout_id``) from 0, because ids are local to each adapter's data source.
  The last group holds what is left over, and ``group_size`` is the number of episodes actually in
  the group.
* Order: groups one after another; inside a group the live episodes advance one turn per round
  and their turns come out in index order, as concurrent engine calls would. The steps of all of
  a round's rollouts are batched: one ``[B, V]`` policy call and one sampling op per step.
* ``publish_generated(settings, publisher, progress=...)`` sends all of it (``rollout_bus.producers.run``) (plus the deliberate
  faults of ``inject_faults``), then, with ``end_of_run`` on, closes the run (``run_id``, or a
  fresh uuid hex) with ``publisher.publish_end_of_run`` once everything is acknowledged, and
  returns a ``GenerateSummary`` naming the run.
* With a ``gate`` (``rollout_bus.producers.staleness_gate.StalenessGate``: the staleness bound and the trainer's live
  version), ``iter_turns(settings, gate)`` calls ``gate.admit(group_index)`` before it starts each group
  (it may wait there for the trainer) and stamps each engine call with ``gate.current()``; without
  one every call carries ``policy_version`` and nothing waits. ``publish_generated(..., gate=gate)``
  puts the least and greatest live versions seen in the summary.
* ``torch_threads`` (when > 0) sets torch's intra-op threads while generating, restored after:
  the per-step ops are small, and thread hand-offs cost more than they give on a busy 2-core box.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from rollout_bus.sim.environment import ToolEnvironment
from rollout_bus.sim.episode import Episode, EpisodeId, TurnDraft
from rollout_bus.sim.faults import FaultPlan
from rollout_bus.sim.interruption import interruption_point
from rollout_bus.sim.policy import Policy
from rollout_bus.sim.sampling import SamplingParams, sample_tokens
from rollout_bus.producers.groups import GroupSpec, parse_adapters, plan_groups
from rollout_bus.producers.run import GenerateSummary, ProgressFn, publish_turns
from rollout_bus.producers.staleness_gate import StalenessGate
from rollout_bus.producers.torch_threads import torch_threads
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError, must_be
from rollout_bus.model.sample import Sample
from rollout_bus.model.turns import split_turn

logger = logging.getLogger(__name__)

_PROMPT_STREAM = 1 << 29
_ENGINE_STREAM = 1 << 28
_INTERRUPT_STREAM = 1 << 27


def sampling_params(settings: GenerateSettings) -> SamplingParams:
    """The sampling parameters of the settings, once their response lengths are checked."""
    if settings.min_response_len > settings.max_response_len:
        raise ConfigError(must_be("min_response_len", f"<= max_response_len={settings.max_response_len}",
                                  settings.min_response_len))
    return SamplingParams(settings.temperature, settings.top_p, settings.top_k, settings.min_p)


def _engine_generator(settings: GenerateSettings, group: GroupSpec, round_: int) -> torch.Generator:
    slot = group.adapter.slot + 1 if group.adapter is not None else 0
    words = [settings.seed, slot, group.group_index, round_, _ENGINE_STREAM]
    seed = int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def _run_engine(policy: Policy, params: SamplingParams, drafts: list[TurnDraft], gen: torch.Generator) -> None:
    """Sample every draft's response, one batched policy step at a time."""
    while True:
        active = [d for d in drafts if d.needs_token]
        if not active:
            return
        prev, last, salt = torch.tensor([d.context() for d in active], dtype=torch.int64).unbind(1)
        draw = sample_tokens(policy.logits(prev, last, salt), params, gen)
        for i, draft in enumerate(active):
            draft.push(int(draw.tokens[i]), float(draw.log_probs[i]), draw.supports[i])


def _group_episodes(settings: GenerateSettings, group: GroupSpec, env: ToolEnvironment,
                    faults: FaultPlan, gate: StalenessGate | None = None,
                    round_version: Callable[[], int] | None = None) -> list[Episode]:
    slot = group.adapter.slot + 1 if group.adapter is not None else 0
    rng = np.random.default_rng([settings.seed, slot, group.group_index, _PROMPT_STREAM])
    name = group.adapter.name if group.adapter is not None else "base"
    prompt, tokens = env.prompt(rng, f"{name}/task-{group.group_index}")
    episodes = []
    for j in range(group.size):
        ident = EpisodeId(group.adapter, group.group_index, group.first_index + j, group.size)
        if gate is None:  # exactly as before: the same settings give the same samples
            episodes.append(Episode(ident, settings, env, prompt, tokens, replay_gap=faults.replay_gap_for(ident)))
        else:
            episodes.append(Episode(ident, settings, env, prompt, tokens, replay_gap=faults.replay_gap_for(ident),
                                    version_of=round_version))
    return episodes


def iter_turns(settings: GenerateSettings, gate: StalenessGate | None = None) -> Iterator[tuple[Sample, dict]]:
    """Every turn of every episode, in publishing order, as ``(sample, publish_turn kwargs)``; with a
    ``gate``, each group starts once the gate admits it and engine calls carry the live version."""
    params = sampling_params(settings)
    faults = FaultPlan(settings, parse_adapters(settings.adapters)[0])
    with torch_threads(settings.torch_threads):
        policy = Policy(settings.vocab_size, settings.seed, dim=settings.policy_dim)
        env = ToolEnvironment(settings.vocab_size)
        for group in plan_groups(**settings.group_plan()):
            if gate is not None:
                gate.admit(group.group_index)
            started: list[int] = [settings.policy_version]  # the live version when the round began
            episodes = _group_episodes(settings, group, env, faults, gate, lambda: started[0])
            yield from group_turns(settings, group, episodes, policy, params, gate, started)


def group_turns(settings: GenerateSettings, group: GroupSpec, episodes: list[Episode], policy: Policy,
                params: SamplingParams, gate: StalenessGate | None, started: list[int],
                engine_call: Callable[[], None] | None = None) -> Iterator[tuple[Sample, dict]]:
    """One prompt group's turns, round by round: every live episode advances one turn per round, sampled in one
    batched engine call (``engine_call()``, when given, runs once per round: a real engine's latency, a stop);
    ``started[0]`` is set to the live version each round begins under."""
    round_, shifts = 0, _TurnShifts()
    while live := [e for e in episodes if not e.done]:
        drafts = [e.begin_turn() for e in live]
        before = started[0] = gate.current() if gate is not None else settings.policy_version
        _run_engine(policy, params, drafts, _engine_generator(settings, group, round_))
        if engine_call is not None:
            engine_call()
        after = gate.current() if gate is not None else before  # new weights live by the round's end?
        for episode, draft in zip(live, drafts):
            yield from shifts.emit(settings, episode, *episode.end_turn(draft), before, after)
        round_ += 1


class _TurnShifts:
    """Interrupted turns (``interrupt_prob``): a turn whose weights changed while it was generated is
    sent as its aborted part (the old version) and its continuation (the new one; see
    ``rollout_bus.sim.interruption``), so every later turn of that attempt moves up by one. A turn not cut
    keeps the version it started under: staleness is never understated."""

    def __init__(self) -> None:
        self.shift: dict[tuple[int, int], int] = {}  # (episode index, attempt) -> extra turns sent

    def emit(self, settings: GenerateSettings, episode: Episode, sample: Sample, args: dict,
             before: int, after: int) -> Iterator[tuple[Sample, dict]]:
        key = (episode.ident.index, args["attempt"])
        args = {**args, "turn": args["turn"] + self.shift.get(key, 0)}
        if after == before or settings.interrupt_prob <= 0:
            yield sample, args
            return
        rng = np.random.default_rng(episode.ident.seed_words(settings.seed, _INTERRUPT_STREAM, args["attempt"],
                                                             args["turn"]))
        at = interruption_point(sample, rng) if rng.random() < settings.interrupt_prob else None
        if at is None:
            yield sample, args
            return
        aborted, continuation = split_turn(sample, at, before, after)
        self.shift[key] = self.shift.get(key, 0) + 1
        yield aborted, {**args, "final": False}
        yield continuation, {**args, "turn": args["turn"] + 1}




def publish_generated(settings: GenerateSettings, publisher, progress: ProgressFn | None = None,
                      gate: StalenessGate | None = None) -> GenerateSummary:
    """Generate and publish everything (``rollout_bus.producers.run.publish_turns``), with the deliberate
    faults of ``inject_faults`` sent after the turns; return what was sent."""

    def faults(summary: GenerateSummary, last_final: tuple[Sample, dict] | None) -> None:
        if settings.inject_faults:
            plan = FaultPlan(settings, parse_adapters(settings.adapters)[0])
            summary.faults = plan.publish(publisher, last_final, summary.episodes)

    return publish_turns(iter_turns(settings, gate), publisher, run_id=settings.run_id, end_of_run=settings.end_of_run,
                         progress=progress, gate=gate, before_flush=faults)
