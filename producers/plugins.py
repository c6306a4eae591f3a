"""The prompt-fed generator's plug-ins: an environment for multi-turn episodes and a reward function, each named
``module:attr`` on the command line (``--env``, ``--reward-fn``, as miles' ``--custom-rm-path``).

Why: the task (what the environment answers, how an answer scores) is the user's code, not the bus's; the bus
only needs two small calls into it and a clear refusal when either misbehaves. Pure: imports the user's module,
calls it, checks what comes back; no I/O of its own.

Contract:

* ``load_plugin(path, flag)`` -> the callable ``path`` names (``module:attr``; ``attr`` may be dotted). A bad
  path is a ``ConfigError``, one line naming ``flag``: no colon (or an empty side), the module not importable
  (and why), the attribute missing, or not callable. ``load_env(path)`` and ``load_reward(path, reward_key)``
  wrap it for ``--env`` and ``--reward-fn``.
* ``episode_so_far(turns)`` -> the episode's turns merged into one sample, a copy: what ``step`` and the reward
  function are given, so a plug-in cannot change what is sent.
* The environment protocol: ``factory(prompt: PromptGroup, sample_index: int)`` -> an env object, one per
  episode (``sample_index`` is ``j`` in ``0..n_samples-1``), with ``step(sample: Sample) -> list[int] | None``:
  ``sample`` is the episode so far (its turns merged: the prompt, each response, the observations between them);
  the answer is the token ids to force as the next observation (they become the next turn's context, and the
  merged episode records them as forced tokens: singleton supports, loss 0, log-prob 0), or None: the episode is
  done. ``step`` is not called after a turn that is the last one allowed (``max_turns``) or that did not
  complete (truncated at ``max_new_tokens``). ``step`` is where side effects happen (a tool runs), so an episode
  resumed from the log never calls it for a step whose answer is on the log: the env's optional
  ``record(sample, observation)`` is called instead, with the episode so far and the logged answer, for the
  env to bring its own state up to date without running anything (an env without it is taken as stateless).
* The reward protocol: ``fn(sample: Sample)`` with the finished episode (merged) returns a number (a bool
  counts 0/1) or a dict whose ``reward_key`` entry (default ``"reward"``) is that number; the number becomes the
  final turn's ``reward`` and a dict is kept whole, as JSON, in its ``metadata["reward_detail"]``. NaN,
  infinities, None, strings, a dict without the key (or not JSON) are refused: never a made-up reward.
* A plug-in that raises, or answers outside its protocol, is a ``PluginFailed``: one line naming the plug-in and
  the episode (``episode_name``). Raised from a generator's ``make_turns`` it fails that delivery of the prompt
  group (``rollout_bus.producers.prompt_member``): delivered again, then dead-lettered ``failed_prompt`` with it.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_bus.errors import ConfigError, RolloutBusError
from rollout_bus.model.sample import Sample, reward_number
from rollout_bus.model.turns import merge_samples
from rollout_bus.wire.compact_json import compact_json
from rollout_bus.wire.prompt_record import PromptGroup

DEFAULT_REWARD_KEY = "reward"


class PluginFailed(RolloutBusError):
    """An environment or reward function raised, or answered outside its protocol, on one episode."""


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def episode_so_far(turns: list[Sample]) -> Sample:
    """The episode so far as one sample: its turns merged, copied (a plug-in cannot change what is sent)."""
    return copy.deepcopy(merge_samples(turns)[-1])


def episode_name(prompt: PromptGroup, sample_index: int) -> str:
    """How an error names an episode: its prompt group and sample."""
    return (f"episode {sample_index} of prompt group {prompt.id} "
            f"(group_index {prompt.group_index}, index {prompt.group_index * prompt.n_samples + sample_index})")


def load_plugin(path: str, flag: str) -> Callable[..., Any]:
    """The callable ``path`` (``module:attr``) names; ``ConfigError`` naming ``flag`` otherwise."""
    module_name, colon, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not colon or not module_name.strip() or not attr.strip() or ":" in attr:
        raise ConfigError(f"{flag} {path!r} must be module:attribute (e.g. my_task.rewards:score)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (whatever importing the user's module raises is the reason given)
        hint = " (is it on PYTHONPATH or installed?)" if isinstance(exc, ModuleNotFoundError) else ""
        raise ConfigError(f"{flag} {path!r}: module {module_name!r} cannot be imported{hint}: "
                          f"{one_line(exc)}") from exc
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"{flag} {path!r}: {attr!r} is a {type(found).__name__}, not a function or class")
    return found


def _name_of(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


@dataclass(frozen=True)
class EnvPlugin:
    """An environment factory and the name errors give it."""

    factory: Callable[[PromptGroup, int], Any]
    name: str

    @classmethod
    def of(cls, factory: "EnvPlugin | Callable[[PromptGroup, int], Any]") -> "EnvPlugin":
        return factory if isinstance(factory, EnvPlugin) else cls(factory, _name_of(factory))

    def open(self, prompt: PromptGroup, sample_index: int) -> "EpisodeEnv":
        """The environment of one episode (the factory's object, checked to have ``step``)."""
        episode = episode_name(prompt, sample_index)
        try:
            env = self.factory(prompt, sample_index)
        except Exception as exc:  # noqa: BLE001
            raise PluginFailed(f"environment {self.name} raised opening {episode}: {one_line(exc)}") from exc
        if not callable(getattr(env, "step", None)):
            raise PluginFailed(f"environment {self.name} gave a {type(env).__name__} for {episode}: it must have "
                               "a step(sample) method")
        return EpisodeEnv(env, self.name, episode)


@dataclass(frozen=True)
class EpisodeEnv:
    env: Any
    name: str
    episode: str

    def step(self, sample: Sample) -> list[int] | None:
        """The observation to force next (a non-empty list of token ids), or None: the episode is done."""
        try:
            answer = self.env.step(sample)
        except Exception as exc:  # noqa: BLE001
            raise PluginFailed(f"environment {self.name} raised on {self.episode}: {one_line(exc)}") from exc
        if answer is None:
            return None
        ids = _token_ids(answer)
        if ids is None:
            shown = " ".join(repr(answer).split())[:80]
            raise PluginFailed(f"environment {self.name} answered {shown} on {self.episode}: step must return a "
                               "non-empty list of token ids (integers >= 0) or None (the episode is done)")
        return ids

    def record(self, sample: Sample, observation: list[int]) -> None:
        """A step whose answer is on the log: given back to the env (its ``record``, if it has one), never run."""
        given = getattr(self.env, "record", None)
        if given is None:
            return
        try:
            given(sample, list(observation))
        except Exception as exc:  # noqa: BLE001
            raise PluginFailed(f"environment {self.name} raised recording a logged step of {self.episode}: "
                               f"{one_line(exc)}") from exc


def _token_ids(answer: Any) -> list[int] | None:
    if isinstance(answer, (str, bytes, dict)):
        return None
    try:
        values = list(answer)
    except TypeError:
        return None
    ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= 0 for v in values)
    return [int(v) for v in values] if values and ok else None


@dataclass(frozen=True)
class RewardPlugin:
    """A reward function, the name errors give it, and the key a dict answer holds the reward under."""

    fn: Callable[[Sample], Any]
    name: str
    reward_key: str = DEFAULT_REWARD_KEY

    @classmethod
    def of(cls, fn: "RewardPlugin | Callable[[Sample], Any]", reward_key: str = DEFAULT_REWARD_KEY) -> "RewardPlugin":
        return fn if isinstance(fn, RewardPlugin) else cls(fn, _name_of(fn), reward_key)

    def score(self, episode_sample: Sample, episode: str) -> tuple[float, dict | None]:
        """``(reward, detail)`` of the finished episode: the number, and the dict when one was returned."""
        try:
            answer = self.fn(episode_sample)
        except Exception as exc:  # noqa: BLE001
            raise PluginFailed(f"reward function {self.name} raised on {episode}: {one_line(exc)}") from exc
        detail = None
        value = answer
        if isinstance(answer, dict):
            if self.reward_key not in answer:
                raise PluginFailed(f"reward function {self.name} returned a dict without the reward key "
                                   f"{self.reward_key!r} (keys {sorted(map(str, answer))[:8]}) on {episode}")
            value = answer[self.reward_key]
            try:
                compact_json(answer, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise PluginFailed(f"reward function {self.name} returned a dict that is not JSON on {episode} "
                                   f"({one_line(exc)})") from exc
            detail = answer
        number = reward_number(value)
        if number is None:
            shown = " ".join(repr(value).split())[:80]
            where = f"[{self.reward_key!r}] " if detail is not None else ""
            raise PluginFailed(f"reward function {self.name} returned {where}{shown} on {episode}: a reward must be a "
                               f"finite number, or a dict with one under {self.reward_key!r}")
        return float(number), detail

    def apply(self, final_turn: Sample, episode_sample: Sample, episode: str) -> None:
        """Score ``episode_sample`` and put the reward on ``final_turn`` (the dict, if any, in its metadata)."""
        reward, detail = self.score(episode_sample, episode)
        final_turn.reward = reward
        if detail is not None:
            final_turn.metadata = {**final_turn.metadata, "reward_detail": detail}


def load_env(path: str) -> EnvPlugin:
    """``--env module:factory``, loaded (``ConfigError`` naming the flag otherwise)."""
    return EnvPlugin(load_plugin(path, "--env"), path)


def load_reward(path: str, reward_key: str = DEFAULT_REWARD_KEY) -> RewardPlugin:
    """``--reward-fn module:function``, loaded (``ConfigError`` naming the flag otherwise)."""
    if not isinstance(reward_key, str) or not reward_key:
        raise ConfigError(f"--reward-key must be a non-empty string (got {reward_key!r})")
    return RewardPlugin(load_plugin(path, "--reward-fn"), path, reward_key)
