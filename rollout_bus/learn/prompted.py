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
  generator's ``--temperature``/``--top-p``/``--top-k``/``--min-p``). ``logged`` (the turns a resumed delivery
  found on the log) changes nothing: every turn is sampled again (a turn the same weights make again is the
  logged one, byte for byte, and is not sent; one the weights since changed make differently is sent, resuming
  the episode there).
* Thread-safe: the member runs prompt groups on worker threads; one engine call at a time (the engine reads
  rollout.weights between decode steps, on a consumer of its own).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import numpy as np

from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ContractError
from rollout_bus.learn.engine import PolicyEngine, TurnOutput
from rollout_bus.learn.generator import FULL_LOG_PROBS, PolicyEpisode, emit_turn, round_generator, turn_sample
from rollout_bus.learn.task import TURN_TOKENS
from rollout_bus.model.sample import AdapterRef, Sample
from rollout_bus.policy.vocab import VOCAB
from rollout_bus.producers.groups import GroupSpec, parse_adapters
from rollout_bus.producers.resume_plan import Logged
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
        going = list(range(n))
        for round_ in range(self.settings.max_turns):
            outs = self._generate([episodes[j].context for j in going], group, round_, tokens)
            next_round = []
            for j, out in zip(going, outs):
                episode = episodes[j]
                sample = turn_sample(group, prompt.text or "", label, episode, out)
                sample.metadata = {**sample.metadata, "prompt_id": prompt.id}
                turns[episode.index].append(sample)
                observation = None
                if envs[j] is not None and round_ + 1 < self.settings.max_turns:
                    observation = envs[j].step(episode_so_far(turns[episode.index]))
                final = observation is None
                if final and self.reward is not None:
                    self.reward.apply(sample, episode_so_far(turns[episode.index]), episode_name(prompt, j))
                yield from emit_turn(sample, episode, out, final=final, group_size=n)
                if not final:
                    episode.context = np.concatenate([sample.tokens, np.asarray(observation, np.int64)])
                    episode.full_log_probs = [*sample.metadata[FULL_LOG_PROBS], *([None] * len(observation))]
                    next_round.append(j)
            going = next_round
            if not going:
                return
