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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
