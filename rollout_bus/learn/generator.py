"""The real policy's generator: calculator episodes sampled by ``PolicyEngine``, published turn by turn.

Where the simulated generator plays an engine, this one is one: each turn is sampled by the policy
the trainer is training, with the weights it last published, and each token carries what a trainer
needs to score it again exactly: its log-prob over the support the sampler really had, that support
(the CSR mask; the calculator's answer is forced, singleton supports), the version of the weights
that produced it, and, as a diagnostic, its full-vocabulary log-prob.

Contract:

* ``iter_policy_turns(settings, engine, gate=None)`` yields ``(sample, publish_turn kwargs)`` like
  ``rollout_bus.sim.generator.iter_turns``: groups from ``plan_groups``, each group's problem from
  ``CalculatorTask(settings.seed)``; with a ``gate``, ``gate.admit(group_index)`` before each group.
  Round 0 samples every episode's first turn from the prompt; an episode whose first turn called the
  tool gets the observation and a second turn (round 1), whose final turn carries the reward; an
  episode that did not call it ends after turn 0 with reward 0. Every decode step of a round is one
  batched forward; the draw is seeded by (seed, adapter slot, group, round), so a run without new
  weights is the same on every machine.
* A turn sample's ``tokens`` are its whole context followed by its response; its per-token fields
  (loss mask 1, rollout log-probs, ``rollout_token_versions``, the mask) cover the response only;
  ``weight_versions`` lists the versions its tokens were sampled under; ``label`` is the answer;
  ``metadata["full_vocab_log_probs"]`` holds the full-vocabulary log-probs of the episode's response
  so far (null for the forced observation tokens), so the merged episode's is its last turn's.
* A turn whose tokens span weight versions (new weights were loaded between its decode steps) is
  sent as ``model.turns.split_turn`` pieces, one per version: ABORTED parts, then the continuation
  (the turn counter moves on by one per piece); merged, they give back the turn exactly.
* ``publish_policy_turns(settings, publisher, watcher=None, progress=None, gate=None, stop=None)`` publishes
  them all (``rollout_bus.producers.run.publish_turns``). Following the trainer (a ``watcher``), it first
  waits for a published, verified checkpoint (``wait_for_first_weights``: an INFO line when it begins
  and every 10 s), so no token comes from weights the trainer does not hold, and the engine loads each
  version the trainer publishes; without one it samples from ``build_policy(settings.seed)``. A published
  version whose checkpoint is missing or fails its sha256 is refused by name (``PolicyEngine``); with none
  verified, ``settings.weights_wait_s`` after the first refusal (0: no limit) it raises
  ``rollout_bus.errors.NoUsableWeights`` naming the version and what is wrong (nothing published yet is
  no error: the trainer may start later). With a staleness ``gate`` the bound counts the version the
  engine runs (``LoadedVersions``): with a version loaded and a newer one refused it goes on with the one
  it has as far as the bound allows, then waits for a newer version, never stopped by ``weights_wait_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout_bus.config import ENV_PREFIX, GenerateSettings
from rollout_bus.errors import ConfigError, NoUsableWeights, Stopped, must_be
from rollout_bus.learn.engine import PolicyEngine, TurnOutput
from rollout_bus.learn.task import TURN_TOKENS, CalculatorTask
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.turns import split_turn
from rollout_bus.policy.sampler import Sampler
from rollout_bus.producers.groups import GroupSpec, plan_groups
from rollout_bus.producers.run import GenerateSummary, ProgressFn, publish_turns
from rollout_bus.producers.staleness_gate import StalenessGate
from rollout_bus.producers.torch_threads import torch_threads
from rollout_bus.wire.weight_version import WeightVersion

logger = logging.getLogger(__name__)

WEIGHTS_WAIT_ENV = f"{ENV_PREFIX}WEIGHTS_WAIT_S"
_ENGINE_STREAM = 1 << 25
FULL_LOG_PROBS = "full_vocab_log_probs"


def round_generator(settings: GenerateSettings, group: GroupSpec, round_: int) -> torch.Generator:
    slot = group.adapter.slot + 1 if group.adapter is not None else 0
    words = [settings.seed, slot, group.group_index, round_, _ENGINE_STREAM]
    seed = int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


@dataclass
class PolicyEpisode:
    """One episode of a group: its index, its context so far, what its turns sampled."""

    index: int
    context: np.ndarray
    turn: int = 0  # the next turn record's number (pieces of a cut turn count one each)
    full_log_probs: list[float | None] = field(default_factory=list)
    called: bool = False


def turn_sample(group: GroupSpec, prompt_text: str, label: str | None, episode: PolicyEpisode,
                out: TurnOutput) -> Sample:
    """One turn as sampled: the episode's context then the turn's tokens; per-token fields over the response."""
    tokens = np.asarray(out.tokens, np.int64)
    versions = np.asarray(out.versions, np.int64)
    sample = Sample(group_index=group.group_index, index=episode.index, rollout_id=episode.index,
                    prompt=prompt_text, label=label, tokens=np.concatenate([episode.context, tokens]),
                    response_length=int(tokens.size), loss_mask=np.ones(tokens.size, np.int64),
                    rollout_log_probs=np.asarray(out.log_probs, np.float64), rollout_token_versions=versions,
                    weight_versions=[str(v) for v in dict.fromkeys(out.versions)], adapter=group.adapter,
                    rollout_sampling_mask=RolloutSamplingMask.from_mask_list(out.supports),
                    status=Status.COMPLETED, metadata={FULL_LOG_PROBS: [*episode.full_log_probs, *out.full_log_probs]})
    sample.validate()
    return sample


def _pieces(sample: Sample, versions: list[int]) -> list[Sample]:
    """The turn as sent: one piece per weight version its tokens span (``split_turn`` at each change)."""
    pieces, rest, start = [], sample, 0
    cuts = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    for cut in cuts:
        aborted, rest = split_turn(rest, cut - start, versions[start], versions[cut])
        pieces.append(aborted)
        start = cut
    pieces.append(rest)
    full = sample.metadata[FULL_LOG_PROBS]
    done = len(full) - len(versions)
    for piece, end in zip(pieces, [*cuts, len(versions)]):  # each piece's diagnostic ends where it does
        piece.metadata = {**piece.metadata, FULL_LOG_PROBS: full[: done + end]}
    return pieces


def emit_turn(sample: Sample, episode: PolicyEpisode, out: TurnOutput, *, final: bool,
              group_size: int, observation: list[int] | None = None) -> Iterator[tuple[Sample, dict]]:
    """The turn's records (one per piece sampled under one version); the last carries ``observation``, the
    environment's answer after the turn, for the prompt-fed member to note with it."""
    pieces = _pieces(sample, out.versions)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        args = {"turn": episode.turn, "attempt": 0, "final": final and last, "group_size": group_size}
        yield piece, ({**args, "observation": observation} if last and observation is not None else args)
        episode.turn += 1


def iter_policy_turns(settings: GenerateSettings, engine: PolicyEngine,
                      gate: StalenessGate | None = None) -> Iterator[tuple[Sample, dict]]:
    """Every turn of every episode, in publishing order (see the module docstring)."""
    task = CalculatorTask(settings.seed)
    for group in plan_groups(**settings.group_plan()):
        if gate is not None:
            gate.admit(group.group_index)
        problem = task.problem(group.group_index)
        prompt = task.prompt_tokens(problem)
        episodes = [PolicyEpisode(group.first_index + j, prompt) for j in range(group.size)]
        outs = engine.generate([e.context for e in episodes], round_generator(settings, group, 0), TURN_TOKENS)
        second: list[PolicyEpisode] = []
        for episode, out in zip(episodes, outs):
            sample = turn_sample(group, problem.text, str(problem.answer), episode, out)
            episode.called = task.calls_tool(out.tokens)
            if not episode.called:
                sample.reward = task.reward(problem, False, out.tokens)
            yield from emit_turn(sample, episode, out, final=not episode.called, group_size=group.size)
            if episode.called:
                observation = task.observation_tokens(problem)
                episode.context = np.concatenate([sample.tokens, observation])
                episode.full_log_probs = [*sample.metadata[FULL_LOG_PROBS], *([None] * observation.size)]
                second.append(episode)
        if not second:
            continue
        outs = engine.generate([e.context for e in second], round_generator(settings, group, 1), TURN_TOKENS)
        for episode, out in zip(second, outs):
            sample = turn_sample(group, problem.text, str(problem.answer), episode, out)
            sample.reward = task.reward(problem, True, out.tokens)
            yield from emit_turn(sample, episode, out, final=True, group_size=group.size)


def wait_for_first_weights(engine: PolicyEngine, refresh: Callable[[int], object], *,
                           stop: Callable[[], bool] | None = None, say_every_s: float = 10.0,
                           give_up_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> int:
    """Block until the engine runs a published, verified checkpoint (the trainer's version 0 or later), so
    the generator never samples from weights the trainer does not have; ``refresh(timeout_ms)`` polls
    rollout.weights. Says what it waits for when it starts and every ``say_every_s`` (a WARNING naming
    the refused version once one was refused). Once a published version was refused and ``give_up_s``
    (None or 0: no limit) passed since with none verified, ``NoUsableWeights`` names the newest refused one."""
    began = said = clock()
    refused_at: float | None = None
    logger.info("waiting for the trainer's first checkpoint on rollout.weights")
    while True:
        engine.refresh()
        if engine.loaded is not None:
            return engine.version
        if stop is not None and stop():
            raise Stopped("stopped while waiting for the trainer's first checkpoint on rollout.weights")
        now = clock()
        if engine.refused and refused_at is None:
            refused_at = now
        if refused_at is not None and give_up_s and now - refused_at >= give_up_s:
            raise NoUsableWeights(f"no usable weights after waiting {now - refused_at:.0f}s: "
                                  f"{_newest_refusal(engine)}, and no newer version came; {engine.using()} "
                                  f"(--weights-wait-s / {WEIGHTS_WAIT_ENV} to wait longer, 0: for ever)")
        refresh(200)
        now = clock()
        if now - said >= say_every_s:
            said = now
            if refused_at is None:
                logger.info("still waiting for the trainer's first checkpoint on rollout.weights (%.0fs)",
                            now - began)
            else:
                left = f"giving up in {max(0.0, give_up_s - (now - refused_at)):.0f}s" if give_up_s else "no limit"
                logger.warning("still no usable weights (%.0fs): %s; %s; waiting for a newer version (%s)",
                               now - began, _newest_refusal(engine), engine.using(), left)


def _newest_refusal(engine: PolicyEngine) -> str:
    return list(engine.refused.values())[-1]


class LoadedVersions:
    """What the staleness gate counts when the policy engine follows the trainer: the version the engine
    runs, not the newest published (a version whose checkpoint was refused is not one it generates under),
    so the bound decides whether it may go on with the version it has. ``refresh()`` takes in rollout.weights
    and loads what is new; ``wait_for(min_version, ...)`` waits on the watcher for a version past the one
    refused, ``on_wait`` told the engine's version."""

    def __init__(self, watcher, engine: PolicyEngine) -> None:
        self.watcher, self.engine = watcher, engine

    @property
    def version(self) -> int:
        return self.engine.version

    def refresh(self) -> int:
        return self.engine.refresh()  # its ``live`` refreshes the watcher

    def wait_for(self, min_version: int, *, timeout_s: float | None = None,
                 on_wait: Callable[[int, int, float], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> int:
        def told(_published: int, _need: int, waited_s: float) -> None:
            on_wait(self.engine.version, min_version, waited_s)

        while self.refresh() < min_version:
            published = self.watcher.version  # at or past min_version yet not loaded: refused, so wait past it
            target = min_version if published < min_version else published + 1
            self.watcher.wait_for(target, timeout_s=timeout_s, on_wait=told if on_wait else None, stop=stop)
        return self.engine.version


def publish_policy_turns(settings: GenerateSettings, publisher, watcher=None, progress: ProgressFn | None = None,
                         gate: StalenessGate | None = None, stop: Callable[[], bool] | None = None,
                         device: str | None = None) -> GenerateSummary:
    """Generate with the real policy and publish (``rollout_bus.producers.run.publish_turns``). With a
    ``watcher`` (a ``WeightWatcher`` on rollout.weights) the engine loads every version the trainer
    publishes, starting with its first, which it waits for; without one it samples from
    ``build_policy(settings.seed)`` as version ``settings.policy_version``."""
    if settings.inject_faults:
        raise ConfigError(must_be("inject_faults", "off with the policy engine (the simulated generator's "
                                  "deliberate faults)", settings.inject_faults))
    sampler = Sampler(settings.temperature, settings.top_p, settings.top_k, settings.min_p)
    if watcher is None:
        engine = PolicyEngine(settings.seed, sampler, version=settings.policy_version, device=device)
    else:
        def live() -> WeightVersion | None:
            watcher.refresh()
            return watcher.latest

        engine = PolicyEngine(settings.seed, sampler, live=live, device=device)
        wait_for_first_weights(engine, lambda ms: watcher.refresh(timeout_ms=ms), stop=stop,
                               give_up_s=settings.weights_wait_s or None)
        if gate is not None:  # the bound counts the version the engine runs (see LoadedVersions)
            gate = StalenessGate(LoadedVersions(watcher, engine), gate.run, on_wait=gate.on_wait, stop=gate.stop)
    with torch_threads(settings.torch_threads):
        summary = publish_turns(iter_policy_turns(settings, engine, gate), publisher, run_id=settings.run_id,
                                end_of_run=settings.end_of_run, progress=progress, gate=gate)
    logger.info("policy engine loaded %d weight versions, refused %d", engine.loads, len(engine.refused))
    return summary
