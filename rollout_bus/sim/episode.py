"""One generated episode: its plan, its turns as per-turn samples, its aborts and retries.

Contract:

* An ``Episode`` is driven turn by turn: ``begin_turn()`` returns a ``TurnDraft`` that the
  generator fills with sampled tokens (``push``) until ``needs_token`` is False, then
  ``end_turn(draft)`` returns the turn's ``(Sample, publish_turn kwargs)``.
* Turn t's sample holds the full history in ``tokens`` (prompt, earlier responses and
  observations, or a fresh summary after a compaction) followed by this turn's response; its
  per-token fields cover only this turn's response, so ``merge_samples`` of the turns gives the
  episode. A tool call inside a response is a second engine call: the tool's output is recorded
  with ``append_forced_sampling_tokens`` (singleton supports), loss mask 0 and log-prob 0.0.
* ``weight_versions`` has one entry per engine call: ``version_of()`` at the call (the trainer's
  live version when the generator follows rollout.weights), else ``policy_version``. The final turn carries the reward (earlier
  turns None) and may be TRUNCATED when it runs to the maximum length; every other turn is
  COMPLETED. ``remove_sample`` is decided once per episode.
* An aborted attempt publishes its turns without ``final``; the episode then calls
  ``reset_for_retry`` and starts again from turn 0 with ``attempt + 1``.
* Every decision comes from a numpy generator seeded by (seed, adapter, group, index, attempt),
  so an episode does not depend on the order in which episodes are generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rollout_bus.sim.environment import ToolEnvironment
from rollout_bus.config import GenerateSettings
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask, SamplingMaskBuilder
from rollout_bus.model.turns import append_forced_sampling_tokens

_REMOVE_STREAM = 1 << 30  # seeds the once-per-episode decisions apart from every attempt's


@dataclass(frozen=True)
class EpisodeId:
    """Who the episode is: adapter, prompt group, sample index (also its rollout id)."""

    adapter: AdapterRef | None
    group_index: int
    index: int
    group_size: int

    def seed_words(self, seed: int, *more: int) -> list[int]:
        slot = self.adapter.slot + 1 if self.adapter is not None else 0
        return [seed, slot, self.group_index, self.index, *more]


@dataclass
class _Call:
    """One engine call: the tokens it sampled, their log-probs and supports."""

    length: int
    tokens: np.ndarray = field(init=False)
    log_probs: np.ndarray = field(init=False)
    mask: SamplingMaskBuilder = field(default_factory=SamplingMaskBuilder)
    filled: int = 0

    def __post_init__(self) -> None:
        self.tokens = np.empty(self.length, dtype=np.int64)
        self.log_probs = np.empty(self.length, dtype=np.float64)


@dataclass
class TurnDraft:
    """A turn being generated: engine calls and forced tool output, in response order."""

    turn: int
    history: np.ndarray
    salt: int
    parts: list[_Call | np.ndarray]
    final: bool
    truncated: bool
    _part: int = 0
    _tail: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tail = [int(t) for t in self.history[-2:]]
        self._skip_forced()

    @property
    def needs_token(self) -> bool:
        return self._part < len(self.parts)

    def context(self) -> tuple[int, int, int]:
        """(previous token, last token, salt): what the policy conditions on."""
        prev = self._tail[-2] if len(self._tail) > 1 else 0
        return prev, self._tail[-1], self.salt

    def push(self, token: int, log_prob: float, support: np.ndarray) -> None:
        """Record one sampled token of the current engine call."""
        call = self.parts[self._part]
        call.tokens[call.filled] = token
        call.log_probs[call.filled] = log_prob
        call.mask.append_row(support)
        call.filled += 1
        self._tail = [self._tail[-1], int(token)]
        if call.filled == call.length:
            self._part += 1
            self._skip_forced()

    def _skip_forced(self) -> None:
        while self._part < len(self.parts) and not isinstance(self.parts[self._part], _Call):
            self._tail = [int(t) for t in self.parts[self._part][-2:]]
            self._part += 1


@dataclass
class _AttemptPlan:
    turns: int
    abort_after: int | None
    truncate_last: bool


class Episode:
    """A rollout generated turn by turn across attempts."""

    def __init__(self, ident: EpisodeId, settings: GenerateSettings, env: ToolEnvironment,
                 prompt: str, prompt_tokens: np.ndarray, *, replay_gap: bool = False,
                 version_of: Callable[[], int] | None = None) -> None:
        self.ident = ident
        self.settings = settings
        # the weight version an engine call runs under: the trainer's live one when following rollout.weights
        self.version_of = version_of or (lambda: settings.policy_version)
        self.env = env
        self.prompt_tokens = prompt_tokens
        self.replay_gap = replay_gap
        rng = np.random.default_rng(ident.seed_words(settings.seed, _REMOVE_STREAM))
        self.remove_sample = bool(rng.random() < settings.remove_prob)
        self.template = Sample(group_index=ident.group_index, index=ident.index, rollout_id=ident.index,
                               prompt=prompt, remove_sample=self.remove_sample, adapter=ident.adapter)
        self.attempt = -1
        self.done = False
        self._start_attempt()

    def _start_attempt(self) -> None:
        s = self.settings
        self.attempt += 1
        self.turn = 0
        self.history = self.prompt_tokens
        self.rng = np.random.default_rng(self.ident.seed_words(s.seed, self.attempt))
        turns = int(self.rng.integers(1, s.max_turns + 1))
        abort = self.attempt < s.max_attempts - 1 and self.rng.random() < s.retry_prob
        abort_after = int(self.rng.integers(0, turns)) if abort else None
        truncate_last = bool(self.rng.random() < s.truncation_prob)
        if self.replay_gap:  # the gap needs a turn to merge with and an episode that finishes
            turns, abort_after = max(turns, min(2, s.max_turns)), None
        self.plan = _AttemptPlan(turns, abort_after, truncate_last)

    def begin_turn(self) -> TurnDraft:
        """Plan the next turn's response: its length, and whether it calls the tool midway."""
        s, plan = self.settings, self.plan
        final = plan.abort_after is None and self.turn == plan.turns - 1
        truncated = final and plan.truncate_last
        length = s.max_response_len if truncated else int(self.rng.integers(s.min_response_len,
                                                                               s.max_response_len + 1))
        parts: list[_Call | np.ndarray] = [_Call(length)]
        if not truncated and length >= 2 and self.rng.random() < s.tool_call_prob:
            split = int(self.rng.integers(1, length))
            parts = [_Call(split), self.env.tool_result(self.rng), _Call(length - split)]
        salt = self.ident.adapter.slot + 1 if self.ident.adapter is not None else 0
        return TurnDraft(self.turn, self.history, salt, parts, final, truncated)

    def end_turn(self, draft: TurnDraft) -> tuple[Sample, dict]:
        """The finished turn's sample and headers; advances to the next turn, attempt or the end."""
        sample = self._turn_sample(draft)
        args = {"turn": draft.turn, "attempt": self.attempt, "final": draft.final,
                "group_size": self.ident.group_size}
        if draft.final:
            sample.reward = self.env.reward(self.rng, truncated=draft.truncated)
            if self.replay_gap:
                sample.rollout_sampling_mask = None
            self.done = True
        elif self.plan.abort_after == draft.turn:
            self.template.reset_for_retry()
            self.template.remove_sample = self.remove_sample  # decided once per episode, not per attempt
            self._start_attempt()
        else:
            self._next_history(np.asarray(sample.tokens))
        return sample, args

    def _next_history(self, tokens: np.ndarray) -> None:
        """The context of the next turn: this one plus an observation, or a fresh summary."""
        self.turn += 1
        if self.rng.random() < self.settings.compaction_prob:
            self.history = self.env.summary(self.rng)
        else:
            self.history = np.concatenate([tokens, self.env.observation(self.rng)])

    def _turn_sample(self, draft: TurnDraft) -> Sample:
        t = self.template
        sample = Sample(group_index=t.group_index, index=t.index, rollout_id=t.rollout_id, prompt=t.prompt,
                        label=t.label, tokens=draft.history, response_length=0, remove_sample=t.remove_sample,
                        metadata=dict(t.metadata), adapter=t.adapter, loss_mask=np.empty(0, np.int64),
                        rollout_log_probs=np.empty(0, np.float64), rollout_token_versions=np.empty(0, np.int64))
        for part in draft.parts:
            if isinstance(part, _Call):
                _append_call(sample, part, self.version_of())
            else:
                _append_forced(sample, part)
        sample.status = Status.TRUNCATED if draft.truncated else Status.COMPLETED
        return sample


def _extend(sample: Sample, tokens: np.ndarray, loss: int, log_probs: np.ndarray, version: int | None) -> None:
    sample.tokens = np.concatenate([sample.tokens, tokens])
    sample.response_length += int(tokens.size)
    sample.loss_mask = np.concatenate([sample.loss_mask, np.full(tokens.size, loss, np.int64)])
    sample.rollout_log_probs = np.concatenate([sample.rollout_log_probs, log_probs])
    if version is not None:  # forced tokens got their -1s from append_forced_sampling_tokens
        sample.rollout_token_versions = np.concatenate([sample.rollout_token_versions,
                                                        np.full(tokens.size, version, np.int64)])


def _append_call(sample: Sample, call: _Call, version: int) -> None:
    """An engine call's output, as an engine adapter appends it."""
    mask = call.mask.build()
    previous = sample.rollout_sampling_mask
    sample.rollout_sampling_mask = mask if previous is None else RolloutSamplingMask.concatenate([previous, mask])
    _extend(sample, call.tokens, 1, call.log_probs, version)
    sample.weight_versions.append(str(version))


def _append_forced(sample: Sample, tokens: np.ndarray) -> None:
    """Tool output inserted into the response: not sampled, not trained on."""
    append_forced_sampling_tokens(sample, tokens)
    _extend(sample, tokens, 0, np.zeros(tokens.size, np.float64), None)
