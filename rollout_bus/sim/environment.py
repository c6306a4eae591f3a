"""A small tool-using environment: prompts, tool results, observations, summaries and rewards.

Contract:

* Everything it returns is decided by the ``numpy.random.Generator`` the caller passes, so an
  episode seeded the same way sees the same environment.
* Token ids are int64 numpy arrays inside ``[0, vocab_size)``. Inserted tokens (tool results,
  observations, summaries) are not sampled by the policy: the generator records them as forced
  (singleton supports, loss mask 0, log-prob 0.0) or as prompt context.
* A prompt starts with ``BOS``, a summary with ``SUMMARY``: a compacted history never starts
  with the tokens it replaces, so ``merge_samples`` sees the compaction.
"""

from __future__ import annotations

import numpy as np

BOS = 1
SUMMARY = 2
TOOL_RESULT = 4
USER = 5
SPECIAL_TOKENS = 16  # ids below this are markers, never content


class ToolEnvironment:
    """Answers turns with tool results and observations; scores finished episodes."""

    def __init__(self, vocab_size: int, *, prompt_len: tuple[int, int] = (24, 64),
                 tool_len: tuple[int, int] = (6, 20), observation_len: tuple[int, int] = (4, 16),
                 summary_len: tuple[int, int] = (8, 24)) -> None:
        self.vocab_size = int(vocab_size)
        self.prompt_len = prompt_len
        self.tool_len = tool_len
        self.observation_len = observation_len
        self.summary_len = summary_len

    def _content(self, rng: np.random.Generator, bounds: tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(SPECIAL_TOKENS, self.vocab_size, size=n, dtype=np.int64)

    def _marked(self, marker: int, body: np.ndarray) -> np.ndarray:
        return np.concatenate([np.array([marker], dtype=np.int64), body])

    def prompt(self, rng: np.random.Generator, task: str) -> tuple[str, np.ndarray]:
        """The task text and its tokens (shared by every episode of a prompt group)."""
        return f"Solve {task} using the calculator tool.", self._marked(BOS, self._content(rng, self.prompt_len))

    def tool_result(self, rng: np.random.Generator) -> np.ndarray:
        """What the tool prints after a call inside a response (forced tokens)."""
        return self._marked(TOOL_RESULT, self._content(rng, self.tool_len))

    def observation(self, rng: np.random.Generator) -> np.ndarray:
        """The user/tool message between two turns (context of the next turn)."""
        return self._marked(USER, self._content(rng, self.observation_len))

    def summary(self, rng: np.random.Generator) -> np.ndarray:
        """A fresh short summary prompt that replaces the history when the session is compacted."""
        return self._marked(SUMMARY, self._content(rng, self.summary_len))

    def reward(self, rng: np.random.Generator, *, truncated: bool) -> float:
        """1.0 for a solved task, 0.0 otherwise; a truncated answer never solves it."""
        solved = rng.random() < 0.5
        return 1.0 if solved and not truncated else 0.0
