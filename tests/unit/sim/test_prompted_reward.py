"""The sim engine on prompt groups takes ``--reward-fn``: the final turn's reward is the function's on the merged
episode; everything else is the same episodes; a function that raises fails the prompt group."""

from __future__ import annotations

import pytest

from rollout_bus.config import GenerateSettings
from rollout_bus.model.turns import merge_samples
from rollout_bus.producers.plugins import PluginFailed, RewardPlugin
from rollout_bus.sim.prompted import SimPromptEngine
from rollout_bus.wire.prompt_record import PromptGroup
from tests import prompt_plugins

SETTINGS = GenerateSettings(max_turns=3, min_response_len=2, max_response_len=6, vocab_size=256, retry_prob=0.3,
                            compaction_prob=0.3, seed=4)
PROMPTS = [PromptGroup(f"p-{g}", g, [5, 6, 7, 300], 3) for g in range(4)]


def _turns(engine: SimPromptEngine) -> list:
    return [turn for prompt in PROMPTS for turn in engine.turns(prompt)]


def test_the_reward_function_scores_each_finished_episode_merged_and_nothing_else_changes():
    plain = _turns(SimPromptEngine(SETTINGS))
    scored = _turns(SimPromptEngine(SETTINGS, reward_fn=RewardPlugin.of(prompt_plugins.response_length)))
    assert [(a, list(s.tokens)) for s, a in plain] == [(a, list(s.tokens)) for s, a in scored]
    finals = 0
    for index in {s.index for s, _ in scored}:
        attempt_turns = [(s, a) for s, a in scored if s.index == index]
        last_attempt = max(a["attempt"] for _, a in attempt_turns)
        episode = [s for s, a in attempt_turns if a["attempt"] == last_attempt]
        assert [s.reward for s in episode[:-1]] == [None] * (len(episode) - 1)
        assert episode[-1].reward == float(merge_samples(episode)[-1].response_length)
        finals += 1
    assert finals == 12


def test_a_reward_function_that_raises_fails_the_prompt_group():
    engine = SimPromptEngine(SETTINGS, reward_fn=RewardPlugin.of(prompt_plugins.raising_reward))
    with pytest.raises(PluginFailed, match=r"reward function tests.prompt_plugins:raising_reward raised on episode \d "
                                           r"of prompt group p-0 \(group_index 0"):
        list(engine.turns(PROMPTS[0]))
