"""A real inference engine behind the prompt-fed generator: SGLang's native ``/generate`` with its supports.

Why: ``rollout-bus generate --from-prompts --engine http`` makes a prompt group's episodes on a real model. The
request rules (``engine_request``: only what the trainer can replay), the client (``engine_client``) and the
answer's reader (``engine_adapter``) are the ones ``publish-from-engine`` uses; here they are driven per prompt
group, with the user's environment and reward (``plugins``) for multi-turn episodes.

Contract:

* ``HttpPromptEngine(engine_url, *, sampling=None, env_factory=None, reward_fn=None, reward_key="reward",
  max_turns=3, timeout_s=120, adapter_slots=None, sample_retries=2)``: ``engine_url`` one URL or several
  (``producers.engine_pool.EnginePool``: a call to an engine that dies goes to the next one, a 4xx goes nowhere
  else); ``turns(prompt, logged=None)`` yields ``(sample, publish_turn kwargs)`` for the ``n_samples`` episodes of ``prompt``,
  one after another (episode j's turns, then j + 1's), each episode's final turn held back until every sample of
  the group is made (so a group that fails leaves no short group behind): group ``prompt.group_index``, index
  and rollout id ``group_index * n_samples + j``, attempt 0 (a retry's: 1, 2, ...), ``group_size``
  ``n_samples``; every turn carries ``metadata["prompt_id"]`` over the prompt's metadata, the label when it is a
  string (another label in ``metadata["label"]``), ``prompt.text`` as its prompt, and the adapter
  (``AdapterRef(name, adapter_slots.get(name, 0))``; the request asks SGLang for it as ``lora_path``).
* Resumed from the log (``logged``: per episode the turns a later delivery found there,
  ``producers.resume_plan.Logged``): an episode continues from them, never asking the engine again. Its logged
  turns are yielded as they are (the member sends none of them again), the environment is given back each logged
  observation (``EpisodeEnv.record``: no tool runs for a step whose answer is on the log), and the next turn's
  context is the last logged turn's tokens and the environment's answer to it: given back too when the last
  turn's mark noted it (every turn's kwargs carry the answer the environment gave after it, ``observation``, which
  the member notes with the turn), run only when the log lacks it. A finished episode is yielded whole and nothing
  is asked. Its attempt is the logged one; a retry of it starts again at turn 0 as the next attempt.
* Sampling: ``sampling`` (the generator's defaults), then the prompt's own ``sampling`` over them; checked by
  ``engine_request`` before any call: a refusal (``ConfigError``) fails the delivery, nothing sent.
* Turn 0 is one ``/generate`` call on ``prompt.input_ids``; the answer becomes the turn sample (context, then the
  output with its supports and log-probs; every check of ``engine_adapter``). With an environment
  (``plugins.EnvPlugin``), after each turn ``env.step(episode so far)`` gives the observation to force: turn
  t+1's context is turn t's tokens and the observation (the merged episode records it as forced tokens with
  singleton supports), until it answers None, ``max_turns`` turns were made, or a turn did not complete
  (truncated: it is the final one). Without one an episode is one turn.
* A turn cut mid-way (the engine answers ``abort`` with partial output: a weight update, a preemption, a replica
  going away) is not thrown away: the partial output is sent as its own turn record (status ``aborted``) and the
  turn continues from it (context = everything so far, ``max_new_tokens`` = what the turn has left), on whichever
  engine of the pool answers; the stream merges the two (WIRE.md 5.1). An episode resumed after a cut part is
  continued the same way. An abort with no output, or at the turn's last token, makes the sample again (below).
* The final turn carries the reward: ``reward_fn(merged episode)`` when given (``plugins.RewardPlugin``);
  else none (None: the trainer leaves it out of its reward statistics). Never a made-up number.
* Group-aware recovery: a sample whose engine call fails (no answer, 5xx, every engine of the pool; or an abort
  with no output to continue from) is made again alone, as the next attempt of its rollout key (the
  stream supersedes what the failed attempt sent), its siblings kept; after ``sample_retries`` retries it is a
  ``SampleFailed`` naming it, and the member fails the prompt group at once (dead-lettered ``failed_prompt``,
  never a placeholder reward, never a short group). An ``EngineRefused`` (4xx: the request is wrong, another try
  would be refused too) also fails the group at once.
* Other failures raise, so the member fails that delivery (delivered again, then dead-lettered with the reason):
  an answer that breaks the contract (``ContractError``), an environment or reward function that raises or
  answers outside its protocol (``PluginFailed``, naming the plug-in and the episode).
  Thread-safe: each call opens its own connection; episodes share nothing.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rollout_bus.errors import EngineError, EngineRefused, SampleFailed
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.producers.engine_adapter import turn_from_engine_response
from rollout_bus.producers.engine_pool import EnginePool
from rollout_bus.producers.engine_request import check_sampling_params, generate_request
from rollout_bus.producers.resume_plan import Logged, env_answer, observation_between
from rollout_bus.producers.plugins import (DEFAULT_REWARD_KEY, EnvPlugin, RewardPlugin, episode_name,
                                          episode_so_far)
from rollout_bus.wire.prompt_record import PromptGroup

DEFAULT_MAX_TURNS = 3
DEFAULT_SAMPLE_RETRIES = 2
logger = logging.getLogger(__name__)


class HttpPromptEngine:
    """Prompt groups made on an SGLang server or router (see the module docstring)."""

    def __init__(self, engine_url: str | Sequence[str], *, sampling: Mapping[str, Any] | None = None,
                 env_factory: EnvPlugin | Callable[[PromptGroup, int], Any] | None = None,
                 reward_fn: RewardPlugin | Callable[[Sample], Any] | None = None,
                 reward_key: str = DEFAULT_REWARD_KEY, max_turns: int = DEFAULT_MAX_TURNS, timeout_s: float = 120.0,
                 adapter_slots: Mapping[str, int] | None = None, sample_retries: int = DEFAULT_SAMPLE_RETRIES) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (got {max_turns})")
        self.client = EnginePool(engine_url, timeout_s=timeout_s)
        self.sampling = dict(sampling or {})
        self.env = EnvPlugin.of(env_factory) if env_factory is not None else None
        self.reward = RewardPlugin.of(reward_fn, reward_key) if reward_fn is not None else None
        self.max_turns = max_turns
        self.sample_retries = int(sample_retries)
        self.adapter_slots = dict(adapter_slots or {})

    def turns(self, prompt: PromptGroup,
              logged: Mapping[int, Logged] | None = None) -> Iterator[tuple[Sample, dict]]:
        params = {**self.sampling, **prompt.sampling}
        check_sampling_params(params)  # a refusal fails the delivery before anything is sent
        finals: list[tuple[Sample, dict]] = []  # sent once every sample of the group is made: never a short group
        for j in range(prompt.n_samples):
            resumed = (logged or {}).get(j)
            first = resumed.attempt if resumed is not None else 0
            for attempt in range(first, first + self.sample_retries + 1):
                try:
                    for sample, args in self._episode(prompt, j, params, attempt,
                                                      resumed if attempt == first else None):
                        if args["final"]:
                            finals.append((sample, args))
                        else:
                            yield sample, args
                    break
                except EngineRefused:
                    raise
                except EngineError as exc:
                    if attempt == first + self.sample_retries:
                        raise SampleFailed(f"{episode_name(prompt, j)}: its engine calls failed on each of its "
                                           f"{attempt + 1} tries (last: {exc}); its siblings were made, the prompt "
                                           "group is failed") from exc
                    logger.warning("%s: engine call failed (%s): re-sampled alone as attempt %d, its siblings kept",
                                   episode_name(prompt, j), exc, attempt + 1)
        yield from finals

    def _template(self, prompt: PromptGroup, j: int) -> Sample:
        index = prompt.group_index * prompt.n_samples + j
        metadata = {**prompt.metadata, "prompt_id": prompt.id}
        if prompt.label is not None and not isinstance(prompt.label, str):
            metadata["label"] = prompt.label
        adapter = AdapterRef(prompt.adapter, self.adapter_slots.get(prompt.adapter, 0)) if prompt.adapter else None
        return Sample(group_index=prompt.group_index, index=index, rollout_id=index, prompt=prompt.text or "",
                      label=prompt.label if isinstance(prompt.label, str) else None, metadata=metadata,
                      adapter=adapter)

    def _call(self, context: list[int], params: Mapping[str, Any], prompt: PromptGroup) -> Any:
        body = generate_request(context, params)
        if prompt.adapter:
            body["lora_path"] = prompt.adapter
        return self.client.post("/generate", body)

    def _episode(self, prompt: PromptGroup, j: int, params: Mapping[str, Any], attempt: int = 0,
                 logged: Logged | None = None) -> Iterator[tuple[Sample, dict]]:
        episode = episode_name(prompt, j)
        template = self._template(prompt, j)
        env = self.env.open(prompt, j) if self.env is not None else None
        context, turns = list(prompt.input_ids), []
        cut: list[Sample] = []  # the cut parts of the engine turn in progress (aborted with partial output)

        def record(sample: Sample, final: bool, observation: list[int] | None = None) -> tuple[Sample, dict]:
            args = {"turn": len(turns) - 1, "attempt": attempt, "final": final, "group_size": prompt.n_samples}
            return sample, args if observation is None else {**args, "observation": observation}

        if logged is not None and logged.turns:  # resumed: the turns the log holds, given back, not asked again
            for k, sample in enumerate(logged.turns):
                turns.append(sample)
                cut = [*cut, sample] if sample.status is Status.ABORTED else []
                final = logged.finished and k == len(logged.turns) - 1
                if env is not None and k + 1 < len(logged.turns) and sample.status is Status.COMPLETED:
                    env.record(episode_so_far(turns), observation_between(sample, logged.turns[k + 1]))
                yield record(sample, final)
            if logged.finished:
                return
            last = turns[-1]
            if last.status is Status.ABORTED:  # cut mid-turn: continued from what was published of it
                context = [int(t) for t in last.tokens]
            else:
                observation = None
                if env is not None and self._rounds(turns) < self.max_turns and last.status is Status.COMPLETED:
                    observation = env_answer(env, episode_so_far(turns), logged, len(turns) - 1)
                if observation is None:  # the environment is done after the last logged turn: it is the final one
                    if self.reward is not None:
                        last = copy.deepcopy(last)
                        self.reward.apply(last, episode_so_far(turns), episode)
                    yield record(last, True)
                    return
                context = [int(t) for t in last.tokens] + observation
        while self._rounds(turns) < self.max_turns or cut:
            response = self._call(context, self._budget(params, cut), prompt)
            sample = turn_from_engine_response(response, context_tokens=context, template=template)
            if sample.status is Status.ABORTED:
                if not sample.response_length or self._budget(params, [*cut, sample]) is None:
                    raise EngineError(f"{self.client.base_url}/generate aborted turn {len(turns)} of {episode} "
                                      f"{'with no output' if not sample.response_length else 'at its last token'}: "
                                      "the sample is made again")
                turns.append(sample)  # what the engine made before it was cut: sent, then continued
                cut.append(sample)
                yield record(sample, False)
                context = [int(t) for t in sample.tokens]
                continue
            cut = []
            turns.append(sample)
            observation = None
            if env is not None and self._rounds(turns) < self.max_turns and sample.status is Status.COMPLETED:
                observation = env.step(episode_so_far(turns))
            final = observation is None
            if final and self.reward is not None:
                self.reward.apply(sample, episode_so_far(turns), episode)
            yield record(sample, final, observation)  # the answer is noted with the turn: never run again
            if final:
                return
            context = [int(t) for t in sample.tokens] + observation

    @staticmethod
    def _rounds(turns: Sequence[Sample]) -> int:
        """Engine turns made: a turn cut mid-way and its continuation are one."""
        return sum(1 for s in turns if s.status is not Status.ABORTED)

    @staticmethod
    def _budget(params: Mapping[str, Any], cut: Sequence[Sample]) -> Mapping[str, Any] | None:
        """The sampling params of the next call: a continuation of a cut turn asks only for the tokens the turn has
        left (``max_new_tokens`` less what its cut parts made); None when nothing is left."""
        made = sum(int(s.response_length) for s in cut)
        if not made or "max_new_tokens" not in params:
            return params
        left = int(params["max_new_tokens"]) - made
        return {**params, "max_new_tokens": left} if left > 0 else None
