"""The seeded engine on a prompt group from rollout.prompts: what an episode holds follows from its identity.

Why: a generator group is only testable if a prompt group made by any member, at any delivery, after any crash,
is the same episodes. Every draw here is seeded by (seed, adapter, group_index, sample index, attempt, round),
as in the built-in generator, and the prompt's tokens come from the record; nothing depends on which member
makes it, when, or how many groups it runs beside it.

Contract:

* ``SimPromptEngine(settings, turn_latency_s=0)``: ``turns(prompt, logged=None)`` yields ``(sample, publish_turn kwargs)``
  for the ``n_samples`` episodes of ``prompt``: group ``prompt.group_index``, sample indices
  ``group_index * n_samples + j``, the record's sampling parameters over the settings', its token ids folded
  into the engine's vocabulary (``id % vocab_size``), ``metadata["prompt_id"]`` on every turn and the label when
  it is a string. Each round of engine calls takes at least ``turn_latency_s`` (a real engine's latency, so a
  fault can land mid-turn), except a round whose every live episode's turn the log already holds (``logged``: per
  episode the turns a resumed delivery found on the log, which it makes again only to reach the same draws, and
  the member does not send: a resumed episode costs the latency of the turns it still lacks). Thread-safe: the policy is shared, read-only (the caller sets torch's threads once).
* ``reward_fn`` (a ``rollout_bus.producers.plugins.RewardPlugin``, ``--reward-fn``): the final turn's reward is
  what it gives for the episode's attempt merged (its last segment when the history was compacted) instead of
  the tool environment's; one that raises fails the delivery (``PluginFailed``). ``--env`` does not apply here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import numpy as np

from rollout_bus.config import GenerateSettings
from rollout_bus.model.sample import AdapterRef, Sample
from rollout_bus.producers.groups import GroupSpec, parse_adapters
from rollout_bus.producers.resume_plan import Logged
from rollout_bus.producers.plugins import RewardPlugin, episode_name, episode_so_far
from rollout_bus.sim.environment import ToolEnvironment
from rollout_bus.sim.episode import Episode, EpisodeId
from rollout_bus.sim.generator import group_turns, sampling_params
from rollout_bus.sim.policy import Policy
from rollout_bus.wire.prompt_record import PromptGroup

_SETTING_OF = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "max_new_tokens": "max_response_len"}


class SimPromptEngine:
    """The seeded stand-in engine, driven by prompt records (see the module docstring)."""

    def __init__(self, settings: GenerateSettings, *, turn_latency_s: float = 0.0,
                 reward_fn: RewardPlugin | None = None) -> None:
        self.settings = settings
        self.turn_latency_s = turn_latency_s
        self.reward_fn = reward_fn
        self.policy = Policy(settings.vocab_size, settings.seed, dim=settings.policy_dim)
        self.env = ToolEnvironment(settings.vocab_size)
        self.slots = {ref.name: ref.slot for ref in parse_adapters(settings.adapters) if ref is not None}

    def _settings_for(self, prompt: PromptGroup) -> GenerateSettings:
        update = {_SETTING_OF[name]: value for name, value in prompt.sampling.items()}
        if "max_response_len" in update:
            update["min_response_len"] = min(self.settings.min_response_len, update["max_response_len"])
        return self.settings.model_copy(update=update) if update else self.settings

    def turns(self, prompt: PromptGroup,
              logged: Mapping[int, Logged] | None = None) -> Iterator[tuple[Sample, dict]]:
        settings = self._settings_for(prompt)
        params = sampling_params(settings)
        adapter = AdapterRef(prompt.adapter, self.slots.get(prompt.adapter, 0)) if prompt.adapter else None
        n = prompt.n_samples
        group = GroupSpec(adapter, prompt.group_index, n, prompt.group_index * n)
        tokens = np.asarray(prompt.input_ids, dtype=np.int64) % settings.vocab_size
        episodes = [Episode(EpisodeId(adapter, group.group_index, group.first_index + j, n), settings, self.env,
                            prompt.text or "", tokens) for j in range(n)]
        pace = _Pace(self.turn_latency_s)
        made = [0] * n  # turns made per episode so far

        def engine_call() -> None:
            if any(j not in (logged or {}) or made[j] >= len(logged[j].turns) for j, e in enumerate(episodes)
                   if not e.done):
                pace()  # a turn the log does not hold yet: a real engine call
            else:
                pace.since = time.monotonic()

        attempts: dict[int, tuple[int, list[Sample]]] = {}  # sample index -> (attempt, its turns so far)
        for sample, args in group_turns(settings, group, episodes, self.policy, params, None,
                                        [settings.policy_version], engine_call=engine_call):
            made[sample.index - group.first_index] += 1
            sample.metadata = {**sample.metadata, "prompt_id": prompt.id}
            if isinstance(prompt.label, str):
                sample.label = prompt.label
            if self.reward_fn is not None:
                self._score(prompt, sample, args, attempts)
            yield sample, args

    def _score(self, prompt: PromptGroup, sample: Sample, args: dict,
               attempts: dict[int, tuple[int, list[Sample]]]) -> None:
        """Keep the turns of each episode's attempt; on its final one, the reward function's reward."""
        attempt, turns = attempts.get(sample.index, (args["attempt"], []))
        if attempt != args["attempt"]:
            turns = []
        turns.append(sample)
        attempts[sample.index] = (args["attempt"], turns)
        if args["final"]:
            merged = episode_so_far(turns)
            j = sample.index - prompt.group_index * prompt.n_samples
            self.reward_fn.apply(sample, merged, episode_name(prompt, j))
            del attempts[sample.index]


class _Pace:
    """Each round of engine calls lasts at least ``latency_s`` since the previous one ended."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.since = time.monotonic()

    def __call__(self) -> None:
        if self.latency_s > 0:
            time.sleep(max(0.0, self.latency_s - (time.monotonic() - self.since)))
        self.since = time.monotonic()
