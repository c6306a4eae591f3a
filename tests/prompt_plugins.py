"""Environments and reward functions for the prompt-fed generator's tests (``--env tests.prompt_plugins:...``,
``--reward-fn tests.prompt_plugins:...``), one per behaviour a test needs."""

from __future__ import annotations

OBSERVATION = [9, 8, 7]  # what the counting environment forces between turns
NOT_CALLABLE = 42


class CountingEnv:
    """Answers ``turns - 1`` times with ``OBSERVATION`` (plus the turn number), then says the episode is done;
    keeps every episode-so-far it was shown."""

    def __init__(self, prompt, sample_index: int, turns: int = 2) -> None:
        self.prompt, self.sample_index, self.turns = prompt, sample_index, turns
        self.seen: list = []

    def step(self, sample):
        self.seen.append(sample)
        return [*OBSERVATION, len(self.seen)] if len(self.seen) < self.turns else None


OPENED: list[CountingEnv] = []


def two_turns(prompt, sample_index):
    env = CountingEnv(prompt, sample_index, turns=2)
    OPENED.append(env)
    return env


def forever(prompt, sample_index):
    """Never says done: the episode ends at max_turns."""
    return CountingEnv(prompt, sample_index, turns=10**6)


def raising_env(prompt, sample_index):
    class Broken:
        def step(self, sample):
            raise RuntimeError("tool server unreachable")

    return Broken()


def no_step(prompt, sample_index):
    return object()


def bad_observation(prompt, sample_index):
    class Bad:
        def step(self, sample):
            return "an observation as text"

    return Bad()


def response_length(sample) -> float:
    """The reward is the episode's response length (tokens generated and forced)."""
    return float(sample.response_length)


def as_dict(sample) -> dict:
    return {"reward": 0.5, "acc": True, "turns": int(sample.response_length)}


def score_key(sample) -> dict:
    return {"score": 1.0}


def text(sample):
    return "great"


def nan(sample) -> float:
    return float("nan")


def raising_reward(sample):
    raise ZeroDivisionError("division by zero in the checker")


def unless_poisoned(sample) -> float:
    """1.0, except for a prompt group whose id says ``poison``: the checker raises on it."""
    if "poison" in sample.metadata["prompt_id"]:
        raise ValueError(f"cannot score {sample.metadata['prompt_id']}")
    return 1.0
