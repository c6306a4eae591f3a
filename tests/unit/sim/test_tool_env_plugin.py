"""The built-in tool environment as an ``--env`` plug-in: loaded by its path, the same answers for the same
episode whoever asks, ids inside the vocabulary, done after at most three observations; a bad vocabulary size
fails the episode by name."""

from __future__ import annotations

import pytest

from rollout_bus.producers.plugins import PluginFailed, load_env
from rollout_bus.sim.environment import SPECIAL_TOKENS, TOOL_ENV_MAX_OBSERVATIONS, USER
from rollout_bus.wire.prompt_record import PromptGroup


def _prompt(pid: str, **metadata) -> PromptGroup:
    return PromptGroup(id=pid, group_index=0, input_ids=[1, 2, 3], n_samples=4, metadata=metadata)


def _answers(env, prompt: PromptGroup, j: int) -> list[list[int] | None]:
    episode = env.open(prompt, j)
    return [episode.step(None) for _ in range(TOOL_ENV_MAX_OBSERVATIONS + 2)]


def test_the_tool_env_answers_by_identity_inside_the_vocabulary_and_ends():
    env = load_env("rollout_bus.sim.environment:tool_env")
    prompt = _prompt("p-7", vocab_size=100)
    counts = set()
    for j in range(16):
        answers = _answers(env, prompt, j)
        assert answers == _answers(env, prompt, j)  # another member, another delivery: the same episode
        given = [a for a in answers if a is not None]
        assert answers[len(given):] == [None] * (len(answers) - len(given))  # done is done
        assert all(a[0] == USER and all(SPECIAL_TOKENS <= t < 100 for t in a[1:]) for a in given)
        counts.add(len(given))
    assert counts == set(range(TOOL_ENV_MAX_OBSERVATIONS + 1))  # 0..3 observations over these episodes
    assert _answers(env, prompt, 0) != _answers(env, _prompt("p-8", vocab_size=100), 0) or \
        _answers(env, prompt, 1) != _answers(env, _prompt("p-8", vocab_size=100), 1)


def test_a_bad_vocabulary_size_fails_the_episode_by_name():
    env = load_env("rollout_bus.sim.environment:tool_env")
    with pytest.raises(PluginFailed, match=r"raised opening episode 2 of prompt group p-1 .*vocab_size must be above"):
        env.open(_prompt("p-1", vocab_size=8), 2)
