"""The real policy on prompt groups from rollout.prompts: ``generate --from-prompts --engine policy``.

Why: ``make learn`` takes its prompts from the bus as a user's run does, so the loop that learns is the loop a
user runs: prompts loaded, a group of generators sharing them, the run closing itself. The turns are the ones
``rollout_bus.learn.generator`` makes for the calculator task (the same draws, per-token versions and cut
turns); the task itself is two plug-ins (``rollout_bus.learn.task:calculator_env`` and ``:calculator_reward``,
the defaults here), so another environment and reward plug in the same way.

Contract:

* ``PolicyPromptEngine(settings, engine, env=None, reward=None)``: ``turns(prompt, logged=None)`` yields ``(sample,
  publish_turn kwargs)`` for the ``n_samples`` episodes of ``prompt``: group ``prompt.group_index``, indices
  ``group_index * n_samples + j``, the prompt's ``input_ids`` as context (each must be a token of the policy's
  vocabulary, else ``ContractError`` naming the prompt: the delivery fails), ``prompt.text`` and a string label
  on every turn, ``metadata["prompt_id"]``. Round r samples the next turn of every episode still going in one
  batched call, seeded by (seed, adapter slot, group index, r) as the built-in generator's rounds are, so the
  same problem at the same group index gives the same turns; a turn is up to ``max_new_tokens`` of the prompt's
  sampling (else ``TURN_TOKENS``). After a turn, ``env.step(episode so far, merged)`` gives the observation to
  force (the next context) or None, and never past ``settings.max_turns`` turns; the final turn carries
  ``reward(merged episode)``. A prompt's other sampling parameters are refused (the policy samples with the
  generator's ``--temperature``/``--top-p``/``--top-k``/``--min-p``).
* Resumed (``logged``: the turns a later delivery found on the log). Under the weights that made them (every
  logged token's version is the engine's), the group is sampled again as it was (the same draws, so the same
  turns, byte for byte, and the member sends none of them again: a run killed at random gives the undisturbed
  run's shards); the environment is given back every answer the log holds (the next logged turn's forced
  tokens, or the one noted with the last: each turn's kwargs carry the environment's answer after it,
  ``observation``) and runs only the steps it lacks. Once the weights moved on, sampling again would make other turns, so each episode continues
  from its logged turns instead: they are yielded as they are, the environment is given back each logged
  observation (``record``) and asked only after the last logged turn (unless noted with it), and a turn whose last logged piece was
  cut (its pieces split at a version change, the rest never published) continues from that piece with the
  tokens it has left. The new tokens carry the version that sampled them, so a resumed turn that spans a weight
  change holds the true per-token versions, and every log-prob stays the one its version gave.
* Thread-safe: the member runs prompt groups on worker threads; one engine call at a time (the engine reads
  rollout.weights between decode steps, on a consumer of its own).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ContractError
from rollout_bus.learn.engine import PolicyEngine, TurnOutput
from rollout_bus.learn.generator import FULL_LOG_PROBS, PolicyEpisode, emit_turn, round_generator, turn_sample
from rollout_bus.learn.task import TURN_TOKENS
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.policy.vocab import VOCAB
from rollout_bus.producers.groups import GroupSpec, parse_adapters
from rollout_bus.producers.resume_plan import Logged, env_answer, observation_between
from rollout_bus.producers.plugins import EnvPlugin, RewardPlugin, episode_name, episode_so_far
from rollout_bus.wire.prompt_record import PromptGroup

TURN_LENGTH = "max_new_tokens"  # the one sampling parameter a prompt may set for the policy


class PolicyPromptEngine:
    """The policy's turns for prompt records (see the module docstring)."""

    def __init__(self, settings: GenerateSettings, engine: PolicyEngine, *, env: EnvPlugin | None = None,
                 reward: RewardPlugin | None = None) -> None:
        self.settings, self.engine, self.env, self.reward = settings, engine, env, reward
        self.slots = {ref.name: ref.slot for ref in parse_adapters(settings.adapters) if ref is not None}
        self.lock = threading.Lock()

    def _generate(self, contexts: list[np.ndarray], group: GroupSpec, round_: int, tokens: int) -> list[TurnOutput]:
        with self.lock:
            return self.engine.generate(contexts, round_generator(self.settings, group, round_), tokens)

    def _moved_on(self, logged: Mapping[int, Logged]) -> bool:
        """Whether some logged token was sampled under other weights than the engine's now."""
        with self.lock:
            now = self.engine.refresh()
        return any(int(v) != now for episode in logged.values() for turn in episode.turns
                   for v in (turn.rollout_token_versions if turn.rollout_token_versions is not None else ()))

    def _resume(self, prompt: PromptGroup, group: GroupSpec, episode: PolicyEpisode, env: Any,
                turns: list[Sample], logged: Logged | None, tokens: int, rounds: list[int], j: int,
                cut: dict[int, int]) -> Iterator[tuple[Sample, dict]]:
        """Episode ``j``'s logged turns, yielded as they are, and its state set to continue after them; returns
        whether it goes on (see the module docstring). Without logged turns it starts at turn 0."""
        if logged is None or not logged.turns:
            return True
        pieces = 0  # response tokens of the turn in progress, in its logged pieces
        for k, sample in enumerate(logged.turns):
            turns.append(sample)
            final = logged.finished and k == len(logged.turns) - 1
            if sample.status is Status.ABORTED:
                pieces += int(sample.response_length)
            else:
                pieces = 0
                rounds[j] += 1
                if env is not None and k + 1 < len(logged.turns):
                    env.record(episode_so_far(turns), observation_between(sample, logged.turns[k + 1]))
            yield sample, {"turn": k, "attempt": 0, "final": final, "group_size": prompt.n_samples}
        episode.turn = len(logged.turns)
        if logged.finished:
            return False
        last = turns[-1]
        if last.status is Status.ABORTED:  # a turn cut at a version change: the rest of it is made now
            episode.context = np.asarray(last.tokens, np.int64)
            episode.full_log_probs = list(last.metadata.get(FULL_LOG_PROBS, []))
            cut[j] = max(1, tokens - pieces)
            return True
        observation = None
        if env is not None and rounds[j] < self.settings.max_turns:
            observation = env_answer(env, episode_so_far(turns), logged, len(logged.turns) - 1)
        if observation is None:  # the environment is done after the last logged turn: that turn is the final one
            final = copy.deepcopy(last)
            if self.reward is not None:
                self.reward.apply(final, episode_so_far(turns), episode_name(prompt, j))
            yield final, {"turn": len(turns) - 1, "attempt": 0, "final": True, "group_size": prompt.n_samples}
            return False
        episode.context = np.concatenate([np.asarray(last.tokens, np.int64), np.asarray(observation, np.int64)])
        episode.full_log_probs = [*last.metadata.get(FULL_LOG_PROBS, []), *([None] * len(observation))]
        return True

    def _checked(self, prompt: PromptGroup) -> tuple[np.ndarray, int]:
        other = sorted(set(prompt.sampling) - {TURN_LENGTH})
        if other:
            raise ContractError(f"prompt group {prompt.id}: sampling {other} cannot be set per prompt for the "
                                "policy engine (it samples with the generator's --temperature/--top-p/--top-k/"
                                "--min-p); only max_new_tokens")
        ids = np.asarray(prompt.input_ids, np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= len(VOCAB)))
        if bad.size:
            raise ContractError(f"prompt group {prompt.id}: input_ids[{int(bad[0])}] = {int(ids[bad[0]])} is not a "
                                f"token of the policy's vocabulary (0..{len(VOCAB) - 1})")
        return ids, int(prompt.sampling.get(TURN_LENGTH, TURN_TOKENS))

    def turns(self, prompt: PromptGroup,
              logged: Mapping[int, Logged] | None = None) -> Iterator[tuple[Sample, dict]]:
        context, tokens = self._checked(prompt)
        adapter = AdapterRef(prompt.adapter, self.slots.get(prompt.adapter, 0)) if prompt.adapter else None
        n = prompt.n_samples
        group = GroupSpec(adapter, prompt.group_index, n, prompt.group_index * n)
        label = prompt.label if isinstance(prompt.label, str) else None
        episodes = [PolicyEpisode(group.first_index + j, context) for j in range(n)]
        envs = [self.env.open(prompt, j) if self.env is not None else None for j in range(n)]
        turns: dict[int, list[Sample]] = {e.index: [] for e in episodes}
        rounds = [0] * n  # engine turns made per episode (the pieces of a turn cut at a version change are one)
        going = list(range(n))
        cut: dict[int, int] = {}  # episode -> tokens its cut turn has left to make
        if logged and self._moved_on(logged):
            going = []
            for j in range(n):
                resumed = yield from self._resume(prompt, group, episodes[j], envs[j], turns[episodes[j].index],
                                                  logged.get(j), tokens, rounds, j, cut)
                if resumed:
                    going.append(j)
        first_round = max(rounds, default=0)
        for round_ in range(first_round, first_round + self.settings.max_turns):
            going = [j for j in going if rounds[j] < self.settings.max_turns]
            if not going:
                return
            continuing = [j for j in going if j in cut]
            outs = dict(zip(continuing, (self._generate([episodes[j].context], group, round_, cut.pop(j))[0]
                                         for j in continuing)))
            fresh = [j for j in going if j not in outs]
            outs.update(zip(fresh, self._generate([episodes[j].context for j in fresh], group, round_, tokens)
                            if fresh else []))
            next_round = []
            for j in going:
                out = outs[j]
                episode = episodes[j]
                sample = turn_sample(group, prompt.text or "", label, episode, out)
                sample.metadata = {**sample.metadata, "prompt_id": prompt.id}
                turns[episode.index].append(sample)
                rounds[j] += 1
                observation = None
                if envs[j] is not None and rounds[j] < self.settings.max_turns:  # given back if on the log
                    observation = env_answer(envs[j], episode_so_far(turns[episode.index]),
                                             (logged or {}).get(j), episode.turn, sample)
                final = observation is None
                if final and self.reward is not None:
                    self.reward.apply(sample, episode_so_far(turns[episode.index]), episode_name(prompt, j))
                yield from emit_turn(sample, episode, out, final=final, group_size=n, observation=observation)
                if not final:
                    episode.context = np.concatenate([sample.tokens, np.asarray(observation, np.int64)])
                    episode.full_log_probs = [*sample.metadata[FULL_LOG_PROBS], *([None] * len(observation))]
                    next_round.append(j)
            going = next_round
