"""The policy on prompt records (``make learn`` from the bus): the calculator task as two plug-ins.

Proven here, on the CPU, without a broker:

* the calculator's prompt lines, loaded as prompt records (``prompt_file``'s checks), played by
  ``PolicyPromptEngine`` with ``calculator_env`` and ``calculator_reward``, give every turn the built-in policy
  generator gives for the same seed (tokens, log-probs, masks, versions, rewards, labels, publish arguments),
  the prompt id added: the task is the plug-ins, not the engine;
* the same prompt made by two engines (as two members would) is the same turns;
* a prompt whose token is outside the policy's vocabulary, or that sets sampling the policy does not take,
  fails by name before any turn; an environment that raises is a ``PluginFailed`` naming the episode;
* the env and the reward read the merged episode: no call, a call then a wrong answer, a call then the
  right one.
"""

from __future__ import annotations

import numpy as np
import pytest

from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ContractError
from rollout_bus.learn.engine import PolicyEngine
from rollout_bus.learn.generator import iter_policy_turns
from rollout_bus.learn.prompted import PolicyPromptEngine
from rollout_bus.learn.task import calculator_env, calculator_reward, prompt_lines
from rollout_bus.model.sample import Sample
from rollout_bus.policy.sampler import Sampler
from rollout_bus.policy.vocab import VOCAB
from rollout_bus.producers.plugins import EnvPlugin, PluginFailed, RewardPlugin
from rollout_bus.wire.prompt_record import PromptGroup

SEED, GROUPS, PER_PROMPT = 28, 7, 4


def _settings(**more) -> GenerateSettings:
    return GenerateSettings(**{"episodes": GROUPS * PER_PROMPT, "n_samples_per_prompt": PER_PROMPT, "top_p": 0.9,
                               "top_k": 20, "seed": SEED, "max_turns": 2, **more})


def _engine(settings: GenerateSettings) -> PolicyEngine:
    return PolicyEngine(settings.seed, Sampler(settings.temperature, settings.top_p, settings.top_k), device="cpu")


def _prompted(settings: GenerateSettings, env=calculator_env, reward=calculator_reward) -> PolicyPromptEngine:
    return PolicyPromptEngine(settings, _engine(settings), env=EnvPlugin.of(env), reward=RewardPlugin.of(reward))


def _records() -> list[PromptGroup]:
    return [PromptGroup(id=line["id"], group_index=g, input_ids=line["input_ids"], n_samples=line["n_samples"],
                        label=line["label"], text=line["text"])
            for g, line in enumerate(prompt_lines(SEED, GROUPS, PER_PROMPT))]


def _facts(sample: Sample, args: dict) -> tuple:
    return (sample.index, sample.group_index, sample.prompt, sample.label, sample.reward, sample.status,
            sample.tokens.tobytes(), sample.loss_mask.tobytes(), sample.rollout_log_probs.tobytes(),
            sample.rollout_token_versions.tobytes(), tuple(sample.weight_versions),
            sample.rollout_sampling_mask.as_arrays()[0].tobytes(), sample.metadata["full_vocab_log_probs"],
            tuple(sorted((k, v) for k, v in args.items() if k != "observation")))  # the answer is noted, not sent


def test_the_calculator_plugins_on_prompt_records_give_the_built_in_generators_turns():
    settings = _settings()
    expected = [_facts(s, a) for s, a in iter_policy_turns(settings, _engine(settings))]
    engine = _prompted(settings)
    got = []
    for record in _records():
        for sample, args in engine.turns(record):
            assert sample.metadata["prompt_id"] == record.id
            got.append(_facts(sample, args))
    assert got == expected
    rewards = [f[4] for f in got if f[4] is not None]
    assert 0.0 in rewards and len(got) > GROUPS * PER_PROMPT  # some episodes called the tool (two turns)


def test_a_prompt_made_by_two_members_is_the_same_turns():
    settings = _settings()
    record = _records()[3]
    first = [_facts(s, a) for s, a in _prompted(settings).turns(record)]
    assert first == [_facts(s, a) for s, a in _prompted(settings).turns(record)]


def test_a_token_outside_the_vocabulary_or_a_sampling_setting_fails_by_name():
    record = _records()[0]
    bad = PromptGroup(id="p-bad", group_index=0, input_ids=[*record.input_ids, 999], n_samples=2, label="3")
    with pytest.raises(ContractError, match=r"prompt group p-bad: input_ids\[\d+\] = 999 is not a token"):
        next(_prompted(_settings()).turns(bad))
    hot = PromptGroup(id="p-hot", group_index=0, input_ids=record.input_ids, n_samples=2, label="3",
                      sampling={"temperature": 0.5})
    with pytest.raises(ContractError, match=r"p-hot: sampling \['temperature'\] cannot be set per prompt"):
        next(_prompted(_settings()).turns(hot))


def _raises(_prompt, _j):
    class Broken:
        def step(self, _sample):
            raise RuntimeError("tool server down")
    return Broken()


def test_an_environment_that_raises_names_the_episode():
    settings = _settings(top_p=1.0, top_k=0, temperature=1.0)
    with pytest.raises(PluginFailed, match=r"raised on episode 0 of prompt group .*tool server down"):
        list(_prompted(settings, env=_raises).turns(_records()[0]))


def _episode(*turns: str, label: str = "8") -> Sample:
    """A merged calculator episode: the prompt, then responses (sampled) and observations (forced, '=d')."""
    prompt = VOCAB.encode("^3+5?")
    tokens, mask = list(prompt), []
    for part in turns:
        ids = list(VOCAB.encode(part))
        tokens += ids
        mask += [0 if part.startswith("=") else 1] * len(ids)
    return Sample(tokens=np.asarray(tokens, np.int64), response_length=len(mask),
                  loss_mask=np.asarray(mask, np.int64), label=label)


def test_the_env_and_reward_read_the_merged_episode():
    record = _records()[0]
    env = calculator_env(record, 0)
    assert env.step(_episode("7$")) is None
    env = calculator_env(record, 0)
    assert VOCAB.decode(env.step(_episode("@1"))) == f"={record.label}"
    assert env.step(_episode("@1", f"={record.label}", "3$")) is None  # never a third turn
    assert calculator_reward(_episode("8$")) == 0.0  # right, but not verified by the calculator
    assert calculator_reward(_episode("@1", "=8", "3$")) == 0.0
    assert calculator_reward(_episode("@1", "=8", "8$")) == 1.0
    with pytest.raises(ValueError, match="must be one digit"):
        calculator_env(PromptGroup(id="p", group_index=0, input_ids=[1], n_samples=1, label="12"), 0)


def test_an_episode_resumed_after_the_weights_moved_on_continues_from_its_logged_turns():
    """Logged turns under version 0, the engine now at version 5: a finished episode is given back whole, one
    with its first turn logged continues from it (its context that turn's tokens and the calculator's answer, its
    reward from the whole episode), the rest start at turn 0; every new token carries version 5 and the logged
    ones keep 0: the merged episode's per-token versions are the true ones across the change."""
    from rollout_bus.model.turns import merge_samples
    from rollout_bus.producers.resume_plan import Logged

    settings = _settings()
    made = _prompted(settings)
    for prompt in _records():
        undisturbed = list(made.turns(prompt))
        by_episode: dict[int, list] = {}
        for sample, args in undisturbed:
            by_episode.setdefault(sample.index - prompt.group_index * prompt.n_samples, []).append((sample, args))
        called = [j for j, turns in by_episode.items() if len(turns) == 2]
        if called and len(called) < prompt.n_samples:
            break
    else:
        pytest.fail("no prompt with an episode that calls the calculator and one that does not")
    j_called, j_done = called[0], next(j for j in by_episode if j not in called)
    first, _ = by_episode[j_called][0]
    logged = {j_called: Logged(0, (first,), False),
              j_done: Logged(0, tuple(s for s, _ in by_episode[j_done]), True)}
    made.engine.version = 5  # the trainer shipped new weights since (the same model here: only the label moves)
    resumed: dict[int, list] = {}
    for sample, args in made.turns(prompt, logged):
        resumed.setdefault(sample.index - prompt.group_index * prompt.n_samples, []).append((sample, args))
    assert [s for s, _ in resumed[j_done]] == [s for s, _ in by_episode[j_done]]  # given back whole, as logged
    (again, a0), (second, a1) = resumed[j_called]
    assert again is first and (a0["turn"], a0["final"], a1["turn"], a1["final"]) == (0, False, 1, True)
    observation = second.tokens[len(first.tokens): len(second.tokens) - second.response_length]
    assert list(second.tokens[:len(first.tokens)]) == list(first.tokens) and len(observation) > 0
    assert set(second.rollout_token_versions.tolist()) == {5} and set(first.rollout_token_versions.tolist()) == {0}
    [episode] = merge_samples([first, second])
    versions = episode.rollout_token_versions.tolist()
    assert versions == [0] * first.response_length + [-1] * len(observation) + [5] * second.response_length
    assert second.reward == calculator_reward(episode)
    others = [j for j in resumed if j not in (j_called, j_done)]
    assert others and all(resumed[j][0][1]["turn"] == 0 and set(resumed[j][0][0].rollout_token_versions.tolist())
                          == {5} for j in others)
