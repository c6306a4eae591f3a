"""The calculator task: a verifiable reward that needs a tool call, small enough to learn in minutes.

A prompt asks for ``(a + b) mod 10`` of two seeded digits (``^3+5?``). The model's first turn may call
the calculator (a response starting with ``@``); the environment then answers with forced observation
tokens (``=8``), and the model's second turn gives the answer (``8$``). The checker accepts only a
calculator-verified answer: the reward is 1.0 when the episode called the tool and its final turn starts
with the right digit, else 0.0 (an unverified guess scores nothing, as a checker that grades the
worked solution would). A randomly initialised model finds this path a few times in a hundred
episodes, which is the signal GRPO needs; learned, it is two decisions: call the tool, then copy
its answer.

Contract:

* ``CalculatorTask(seed)``: ``problem(group_index)`` is fixed by (seed, group index); every episode
  of a prompt group gets the same problem.
* ``prompt_tokens(problem)``, ``observation_tokens(problem)`` (the tool's answer, forced tokens);
  ``TURN_TOKENS`` caps a turn (a turn also ends at ``$``); ``MAX_TURNS`` is 2.
* ``calls_tool(response)``: the response starts with the call token. ``reward(problem, called, final)``.
* On the bus (``make learn`` takes its prompts from rollout.prompts): ``prompt_lines(seed, groups, n_samples)``
  are the prompt file's lines of problems ``0..groups-1`` (``input_ids`` the prompt's tokens, ``label`` the
  answer digit); ``calculator_env`` is the ``--env`` plug-in (``rollout_bus.learn.task:calculator_env``: after a
  first turn that called the tool it forces the calculator's answer for the prompt's label, else the episode is
  done; never after a second turn) and ``calculator_reward`` the ``--reward-fn`` one (the checker on the merged
  episode: its first response segment called the tool and its last, another one, starts with the label).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_bus.policy.vocab import BOS, CALL, PLUS, QUESTION, ANSWER, VOCAB

TURN_TOKENS = 2
MAX_TURNS = 2
_PROBLEM_STREAM = 1 << 26


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return (self.a + self.b) % 10

    @property
    def text(self) -> str:
        return f"{BOS}{self.a}{PLUS}{self.b}{QUESTION}"


class CalculatorTask:
    """Problems, the calculator's answers and the checker."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def problem(self, group_index: int) -> Problem:
        rng = np.random.default_rng([self.seed, int(group_index), _PROBLEM_STREAM])
        a, b = (int(x) for x in rng.integers(0, 10, size=2))
        return Problem(a, b)

    @staticmethod
    def prompt_tokens(problem: Problem) -> np.ndarray:
        return VOCAB.encode(problem.text)

    @staticmethod
    def observation_tokens(problem: Problem) -> np.ndarray:
        """What the calculator prints: ``=`` and the answer digit."""
        return VOCAB.encode(f"{ANSWER}{problem.answer}")

    @staticmethod
    def calls_tool(response: Sequence[int]) -> bool:
        return len(response) > 0 and int(response[0]) == VOCAB.id(CALL)

    @staticmethod
    def reward(problem: Problem, called: bool, final: Sequence[int]) -> float:
        right = len(final) > 0 and int(final[0]) == VOCAB.id(str(problem.answer))
        return 1.0 if called and right else 0.0


def prompt_lines(seed: int, groups: int, n_samples: int) -> list[dict[str, Any]]:
    """The prompt file of problems ``0..groups-1``, one JSON object each (``rollout-bus prompts load``'s fields)."""
    task = CalculatorTask(seed)
    lines = []
    for group_index in range(groups):
        problem = task.problem(group_index)
        lines.append({"id": f"calculator-{seed}-{group_index}", "text": problem.text, "label": str(problem.answer),
                      "input_ids": [int(t) for t in task.prompt_tokens(problem)], "n_samples": int(n_samples)})
    return lines


def response_segments(sample: Any) -> list[np.ndarray]:
    """The sampled parts of an episode's response (loss mask 1), one per turn, in order."""
    response = np.asarray(sample.tokens, np.int64)[len(sample.tokens) - int(sample.response_length):]
    mask = np.asarray(sample.loss_mask, np.int64)
    segments, current = [], []
    for token, sampled in zip(response, mask):
        if sampled:
            current.append(int(token))
        elif current:
            segments.append(np.asarray(current, np.int64))
            current = []
    if current:
        segments.append(np.asarray(current, np.int64))
    return segments


class CalculatorEnv:
    """One episode's calculator: the answer to the prompt's label, forced after a first turn that calls it."""

    def __init__(self, answer: str) -> None:
        if len(answer) != 1 or answer not in "0123456789":
            raise ValueError(f"the calculator task's label must be one digit (got {answer!r})")
        self.answer, self.steps = answer, 0

    def step(self, sample: Any) -> list[int] | None:
        self.steps += 1
        segments = response_segments(sample)
        if self.steps > 1 or len(segments) != 1 or not CalculatorTask.calls_tool(segments[0]):
            return None
        return [int(t) for t in VOCAB.encode(f"{ANSWER}{self.answer}")]

    def record(self, sample: Any, observation: list[int]) -> None:
        """A step a resumed episode found on the log: counted, the calculator is not asked again."""
        self.steps += 1


def calculator_env(prompt: Any, sample_index: int) -> CalculatorEnv:
    """``--env rollout_bus.learn.task:calculator_env``: the calculator of one episode of ``prompt``."""
    return CalculatorEnv(str(prompt.label))


def calculator_reward(sample: Any) -> float:
    """``--reward-fn rollout_bus.learn.task:calculator_reward``: 1.0 for a calculator-verified right answer."""
    segments = response_segments(sample)
    called = len(segments) > 1 and CalculatorTask.calls_tool(segments[0])
    right = called and len(segments[-1]) > 0 and VOCAB.decode(segments[-1][:1]) == str(sample.label)
    return 1.0 if right else 0.0
