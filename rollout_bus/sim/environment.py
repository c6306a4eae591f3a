"""A small tool-using environment: prompts, tool results, observations, summaries and rewards.

Contract:

* Everything it returns is decided by the ``numpy.random.Generator`` the caller passes, so an
  episode seeded the same way sees the same environment.
* Token ids are int64 numpy arrays inside ``[0, vocab_size)``. Inserted tokens (tool results,
  observations, summaries) are not sampled by the policy: the generator records them as forced
  (singleton supports, loss mask 0, log-prob 0.0) or as prompt context.
* A prompt starts with ``BOS``, a summary with ``SUMMARY``: a compacted history never starts
  with the tokens it replaces, so ``merge_samples`` sees the compaction.
* ``tool_env`` is the same environment as an ``--env`` plug-in (``rollout_bus.sim.environment:tool_env``) for
  the prompt-fed generator's real engines: seeded by the prompt's id and the sample index, up to three
  observations, then done.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

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


DEFAULT_TOOL_VOCAB = 32_000  # a typical LLM's vocabulary: the observations' ids stay below it
TOOL_ENV_MAX_OBSERVATIONS = 3
_TOOL_ENV_STREAM = 1 << 27


class ToolEnvEpisode:
    """One episode of the built-in tool environment as an ``--env`` plug-in (``tool_env``): after each turn, a
    seeded observation (``USER`` and content ids), until a seeded number of them (0 to 3) was given. What it
    answers depends on the prompt's id, the sample index and the step only: any generator, any delivery, the
    same episode. ``executed`` counts the tool calls it ran (each logged at INFO, so a test counts them across
    processes); ``record(sample, observation)`` takes back a step a resumed episode found on the log: its state
    moves on as if the call had run, and nothing runs."""

    def __init__(self, prompt_id: str, sample_index: int, vocab_size: int) -> None:
        words = [int(b) for b in prompt_id.encode("utf-8")]
        self.rng = np.random.default_rng([_TOOL_ENV_STREAM, int(sample_index), len(words), *words])
        self.env = ToolEnvironment(vocab_size)
        self.observations = int(self.rng.integers(0, TOOL_ENV_MAX_OBSERVATIONS + 1))
        self.prompt_id, self.sample_index = prompt_id, sample_index
        self.steps = 0  # steps taken, run or recorded
        self.executed = 0

    def step(self, _sample) -> list[int] | None:
        self.steps += 1
        if self.steps > self.observations:
            return None
        self.executed += 1
        logger.info("tool call executed: prompt group %s episode %d step %d", self.prompt_id, self.sample_index,
                    self.steps)
        return [int(t) for t in self.env.observation(self.rng)]

    def record(self, _sample, observation: list[int]) -> None:
        self.steps += 1
        answer = [int(t) for t in self.env.observation(self.rng)]  # the same draw: the state moves on
        if answer != list(observation):
            raise ValueError(f"the logged observation of step {self.steps} is not this environment's answer "
                             f"(prompt group {self.prompt_id}, episode {self.sample_index})")


def tool_env(prompt, sample_index: int) -> ToolEnvEpisode:
    """``--env rollout_bus.sim.environment:tool_env``: the built-in tool environment for a real engine's episodes;
    ids below the prompt's ``metadata["vocab_size"]`` (default ``DEFAULT_TOOL_VOCAB``)."""
    vocab = int(prompt.metadata.get("vocab_size", DEFAULT_TOOL_VOCAB)) if prompt.metadata else DEFAULT_TOOL_VOCAB
    if vocab <= SPECIAL_TOKENS:
        raise ValueError(f"metadata vocab_size must be above {SPECIAL_TOKENS} (got {vocab})")
    return ToolEnvEpisode(prompt.id, sample_index, vocab)
