"""The prompt-fed generator's plug-ins: every bad ``module:attr`` is one line naming the flag and what is wrong;
an environment or reward that raises or answers outside its protocol is one line naming the plug-in and the
episode, and never becomes a reward."""

from __future__ import annotations

import sys

import pytest

from rollout_bus.errors import ConfigError
from rollout_bus.model.sample import Sample
from rollout_bus.producers.plugins import (EnvPlugin, PluginFailed, RewardPlugin, episode_name, load_env,
                                           load_plugin, load_reward)
from rollout_bus.wire.prompt_record import PromptGroup
from tests import prompt_plugins

PROMPT = PromptGroup("p-1", 3, [5, 6], 4)
EPISODE = episode_name(PROMPT, 1)


def test_a_good_path_gives_the_callable_dotted_attributes_too():
    assert load_plugin("tests.prompt_plugins:two_turns", "--env") is prompt_plugins.two_turns
    assert load_plugin("tests.prompt_plugins:CountingEnv.step", "--env") is prompt_plugins.CountingEnv.step
    assert load_env("tests.prompt_plugins:two_turns").name == "tests.prompt_plugins:two_turns"
    assert load_reward("tests.prompt_plugins:as_dict", "acc").reward_key == "acc"


@pytest.mark.parametrize("path, flag, message", [
    ("tests.prompt_plugins", "--reward-fn", "--reward-fn 'tests.prompt_plugins' must be module:attribute"),
    (":score", "--reward-fn", "must be module:attribute"),
    ("tests.prompt_plugins:", "--env", "--env 'tests.prompt_plugins:' must be module:attribute"),
    ("a:b:c", "--env", "must be module:attribute"),
    ("no_such_module_here:score", "--reward-fn", "--reward-fn 'no_such_module_here:score': module "
     "'no_such_module_here' cannot be imported (is it on PYTHONPATH or installed?): ModuleNotFoundError: No module "
     "named 'no_such_module_here'"),
    ("tests.prompt_plugins:missing", "--reward-fn", "--reward-fn 'tests.prompt_plugins:missing': module "
     "'tests.prompt_plugins' has no attribute 'missing'"),
    ("tests.prompt_plugins:NOT_CALLABLE", "--env", "--env 'tests.prompt_plugins:NOT_CALLABLE': 'NOT_CALLABLE' is a "
     "int, not a function or class"),
])
def test_every_bad_path_is_one_line_naming_the_flag(path, flag, message):
    with pytest.raises(ConfigError) as refused:
        load_plugin(path, flag)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_module_that_fails_on_import_says_why(tmp_path, monkeypatch):
    (tmp_path / "broken_task.py").write_text("import math\nraise RuntimeError('needs a GPU\\nat import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        load_reward("broken_task:score")
    assert str(refused.value) == ("--reward-fn 'broken_task:score': module 'broken_task' cannot be imported: "
                                  "RuntimeError: needs a GPU at import")
    sys.modules.pop("broken_task", None)


def test_an_empty_reward_key_is_refused():
    with pytest.raises(ConfigError, match="--reward-key"):
        load_reward("tests.prompt_plugins:as_dict", "")


def _sample(length: int = 3) -> Sample:
    return Sample(group_index=3, index=13, rollout_id=13, tokens=list(range(5 + length)), response_length=length)


def test_a_number_or_a_dict_with_the_key_is_the_reward_and_the_dict_is_kept():
    assert RewardPlugin.of(prompt_plugins.response_length).score(_sample(4), EPISODE) == (4.0, None)
    final = _sample()
    RewardPlugin.of(prompt_plugins.as_dict).apply(final, _sample(), EPISODE)
    assert final.reward == 0.5 and final.metadata["reward_detail"] == {"reward": 0.5, "acc": True, "turns": 3}
    assert RewardPlugin.of(prompt_plugins.score_key, "score").score(_sample(), EPISODE) == (1.0, {"score": 1.0})
    assert RewardPlugin.of(lambda s: True).score(_sample(), EPISODE) == (1.0, None)


@pytest.mark.parametrize("fn, key, message", [
    (prompt_plugins.raising_reward, "reward", "reward function tests.prompt_plugins:raising_reward raised on episode 1 "
     "of prompt group p-1 (group_index 3, index 13): ZeroDivisionError: division by zero in the checker"),
    (prompt_plugins.text, "reward", "returned 'great' on episode 1 of prompt group p-1"),
    (prompt_plugins.nan, "reward", "returned nan on episode 1"),
    (lambda s: None, "reward", "returned None on episode 1"),
    (prompt_plugins.score_key, "reward", "returned a dict without the reward key 'reward' (keys ['score'])"),
    (lambda s: {"reward": "high"}, "reward", "returned ['reward'] 'high' on episode 1"),
    (lambda s: {"reward": 1.0, "raw": object()}, "reward", "returned a dict that is not JSON"),
])
def test_a_reward_that_raises_or_is_not_a_number_is_one_line_and_no_reward(fn, key, message):
    final = _sample()
    with pytest.raises(PluginFailed) as failed:
        RewardPlugin.of(fn, key).apply(final, _sample(), EPISODE)
    assert message in str(failed.value) and "\n" not in str(failed.value)
    assert final.reward is None and "reward_detail" not in final.metadata


def test_an_environment_gives_token_ids_or_none():
    env = EnvPlugin.of(prompt_plugins.two_turns).open(PROMPT, 1)
    assert env.step(_sample()) == [*prompt_plugins.OBSERVATION, 1]
    assert env.step(_sample()) is None


@pytest.mark.parametrize("factory, message", [
    (prompt_plugins.raising_env, "environment tests.prompt_plugins:raising_env raised on episode 1 of prompt group "
     "p-1 (group_index 3, index 13): RuntimeError: tool server unreachable"),
    (prompt_plugins.bad_observation, "answered 'an observation as text' on episode 1 of prompt group p-1"),
    (lambda p, j: type("E", (), {"step": lambda self, s: []})(), "answered [] on episode 1"),
    (lambda p, j: type("E", (), {"step": lambda self, s: [3, -1]})(), "answered [3, -1] on episode 1"),
    (prompt_plugins.no_step, "gave a object for episode 1 of prompt group p-1 (group_index 3, index 13): it must "
     "have a step(sample) method"),
    (lambda p, j: 1 / 0, "raised opening episode 1 of prompt group p-1"),
])
def test_an_environment_that_raises_or_answers_badly_is_one_line_naming_it_and_the_episode(factory, message):
    with pytest.raises(PluginFailed) as failed:
        EnvPlugin.of(factory).open(PROMPT, 1).step(_sample())
    assert message in str(failed.value) and "\n" not in str(failed.value)
