"""`rollout-bus generate --from-prompts`'s engine flags: --engine http needs --engine-url, a bad --env or
--reward-fn path is one line and exit 2 before the member goes near the broker, and the flags reach the engine."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from rollout_bus.cli.generate_prompts import prompt_engine
from rollout_bus.cli.main import app
from rollout_bus.config import GenerateSettings
from rollout_bus.producers.http_prompt_engine import HttpPromptEngine
from rollout_bus.sim.prompted import SimPromptEngine
from tests import prompt_plugins

CLOSED = "127.0.0.1:1"  # nothing listens there: a refusal must come before any broker is asked
runner = CliRunner()


def refusal(*args: str) -> str:
    began = time.monotonic()
    done = runner.invoke(app, ["generate", "--from-prompts", "--bootstrap-servers", CLOSED, *args])
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert done.exit_code == 2, done.output
    assert time.monotonic() - began < 10, "it waited for the broker before refusing"
    return lines[-1]


@pytest.mark.parametrize("args, line", [
    (["--engine", "http"], "error: --engine http needs --engine-url"),
    (["--engine", "http", "--engine-url", "http://127.0.0.1:9", "--reward-fn", "tests.prompt_plugins"],
     "generator refused: --reward-fn 'tests.prompt_plugins' must be module:attribute"),
    (["--engine", "http", "--engine-url", "http://127.0.0.1:9", "--env", "tests.prompt_plugins:missing"],
     "generator refused: --env 'tests.prompt_plugins:missing': module 'tests.prompt_plugins' has no attribute "
     "'missing'"),
    (["--reward-fn", "nowhere_to_be_found:score"], "generator refused: --reward-fn 'nowhere_to_be_found:score': "
     "module 'nowhere_to_be_found' cannot be imported"),
    (["--env", "tests.prompt_plugins:two_turns"], "error: --env drives --engine http or policy"),
])
def test_a_missing_url_or_bad_plugin_path_is_one_line_and_exit_2_before_the_broker(args, line):
    assert refusal(*args).startswith(line)


def test_engine_http_without_from_prompts_is_refused():
    done = runner.invoke(app, ["generate", "--bootstrap-servers", CLOSED, "--engine", "http"])
    assert done.exit_code == 2 and "--from-prompts" in done.output


def test_the_flags_reach_the_http_engine():
    settings = GenerateSettings(from_prompts=True, engine="http", engine_url="http://engine:30000/",
                                env_factory="tests.prompt_plugins:two_turns",
                                reward_fn="tests.prompt_plugins:score_key", reward_key="score", max_turns=5,
                                top_p=0.9, top_k=0, max_response_len=40, adapters="math,code")
    make_turns, uses_torch, *_ = prompt_engine(settings)
    engine = make_turns.__self__
    assert isinstance(engine, HttpPromptEngine) and not uses_torch
    assert engine.client.base_url == "http://engine:30000" and engine.max_turns == 5
    assert engine.env.factory is prompt_plugins.two_turns and engine.reward.fn is prompt_plugins.score_key
    assert engine.reward.reward_key == "score" and engine.adapter_slots == {"math": 0, "code": 1}
    assert engine.sampling == {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "max_new_tokens": 40}


def test_the_sim_engine_takes_the_reward_function():
    make_turns, uses_torch, *_ = prompt_engine(GenerateSettings(from_prompts=True,
                                                            reward_fn="tests.prompt_plugins:response_length"))
    assert isinstance(make_turns.__self__, SimPromptEngine) and uses_torch
    assert make_turns.__self__.reward_fn.fn is prompt_plugins.response_length


def test_the_policy_engine_takes_the_calculator_task_unless_told_otherwise():
    from rollout_bus.learn import task
    from rollout_bus.learn.prompted import PolicyPromptEngine

    chosen = prompt_engine(GenerateSettings(from_prompts=True, engine="policy", max_turns=2))
    engine = chosen.make_turns.__self__
    assert isinstance(engine, PolicyPromptEngine) and chosen.uses_torch
    assert engine.env.factory is task.calculator_env and engine.reward.fn is task.calculator_reward
    other = prompt_engine(GenerateSettings(from_prompts=True, engine="policy",
                                           env_factory="tests.prompt_plugins:two_turns",
                                           reward_fn="tests.prompt_plugins:response_length")).make_turns.__self__
    assert other.env.factory is prompt_plugins.two_turns and other.reward.fn is prompt_plugins.response_length
