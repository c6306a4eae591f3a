"""The http engine of the prompt-fed generator against a local server in SGLang's shapes: one turn per episode
without an environment, multi-turn with one (observations forced, the reward on the final turn from the merged
episode), and every failure raised so the member fails the delivery."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from rollout_bus.errors import ConfigError, EngineRefused, SampleFailed
from rollout_bus.model.sample import AdapterRef, Status
from rollout_bus.model.turns import merge_samples
from rollout_bus.producers.http_prompt_engine import HttpPromptEngine
from rollout_bus.producers.plugins import PluginFailed, load_env, load_reward
from rollout_bus.wire.prompt_record import PromptGroup
from tests import prompt_plugins
from tests.engine_server import FixtureEngine, fixture

DEFAULTS = {"temperature": 1.0, "top_p": 0.95, "top_k": 64, "min_p": 0.0, "max_new_tokens": 3}
PROMPT = PromptGroup("p-7", 3, [5, 6, 7], 2, label="Paris", metadata={"source": "geo"},
                     sampling={"temperature": 0.7, "top_k": 20}, text="capital of France?")
OUTPUT = [12095, 13, 576]  # what the fixture generates


@pytest.fixture
def engine():
    with FixtureEngine() as server:
        yield server


def completing(server: FixtureEngine) -> None:
    """Answer with turns that complete (the fixture's own runs to max_new_tokens: TRUNCATED)."""
    answer = copy.deepcopy(fixture("generate_mask_only"))
    answer["meta_info"]["finish_reason"] = {"type": "stop", "matched": 2}
    server.answer("/generate", answer)


def test_one_turn_per_episode_with_the_prompts_identity_and_sampling(engine):
    adapters = PromptGroup("p-8", 0, [1, 2], 1, label={"answer": 4}, adapter="math", sampling={"top_p": 0.5})
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, adapter_slots={"code": 0, "math": 1})
    turns = list(made.turns(PROMPT)) + list(made.turns(adapters))
    assert [args for _, args in turns] == [{"turn": 0, "attempt": 0, "final": True, "group_size": 2}] * 2 + \
        [{"turn": 0, "attempt": 0, "final": True, "group_size": 1}]
    first, second, third = (sample for sample, _ in turns)
    assert [(s.group_index, s.index, s.rollout_id) for s in (first, second, third)] == [(3, 6, 6), (3, 7, 7), (0, 0, 0)]
    assert list(first.tokens) == [5, 6, 7, *OUTPUT] and first.response_length == 3
    assert first.status is Status.TRUNCATED and first.reward is None  # no reward function: no reward
    assert first.metadata == {"source": "geo", "prompt_id": "p-7"} and first.label == "Paris"
    assert first.prompt == "capital of France?" and first.adapter is None
    assert third.label is None and third.metadata["label"] == {"answer": 4} and third.adapter == AdapterRef("math", 1)
    bodies = [body for _, body in engine.requests]
    assert bodies[0] == {"input_ids": [5, 6, 7], "return_sampling_mask": True,
                         "sampling_params": {**DEFAULTS, "temperature": 0.7, "top_k": 20}}
    assert bodies[2]["lora_path"] == "math" and bodies[2]["sampling_params"]["top_p"] == 0.5
    assert "lora_path" not in bodies[0]


def test_an_environment_makes_multi_turn_episodes_and_the_reward_scores_the_merged_episode(engine):
    completing(engine)
    prompt_plugins.OPENED.clear()
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, env_factory=load_env("tests.prompt_plugins:two_turns"),
                            reward_fn=load_reward("tests.prompt_plugins:response_length"), max_turns=4)
    turns = list(made.turns(PROMPT))
    # the finals held back until every sample of the group is made
    assert [(s.index, a["turn"], a["final"]) for s, a in turns] == [(6, 0, False), (7, 0, False), (6, 1, True),
                                                                       (7, 1, True)]
    first, last = turns[0][0], turns[2][0]
    observation = [*prompt_plugins.OBSERVATION, 1]
    assert list(last.tokens) == [5, 6, 7, *OUTPUT, *observation, *OUTPUT]  # the observation is the next context
    assert engine.requests[1][1]["input_ids"] == [5, 6, 7, *OUTPUT, *observation]
    assert first.reward is None and last.reward == 3 + 4 + 3  # responses and the forced observation
    [episode] = merge_samples([first, last])
    mask = episode.rollout_sampling_mask
    assert [mask.row(t).tolist() for t in range(3, 7)] == [[t] for t in observation]  # singleton supports
    assert list(episode.loss_mask) == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert np.allclose(np.asarray(episode.rollout_log_probs)[3:7], 0.0)
    env = prompt_plugins.OPENED[0]
    assert (env.prompt.id, env.sample_index) == ("p-7", 0) and env.seen[0].response_length == 3


def test_an_episode_ends_at_max_turns_or_at_a_turn_that_did_not_complete(engine):
    completing(engine)
    capped = HttpPromptEngine(engine.url, sampling=DEFAULTS, env_factory=prompt_plugins.forever, max_turns=3)
    one = PromptGroup("p-1", 0, [5], 1)
    assert [(a["turn"], a["final"]) for _, a in capped.turns(one)] == [(0, False), (1, False), (2, True)]
    engine.answer("/generate", fixture("generate_mask_only"))  # truncated at max_new_tokens: nothing to continue
    truncated = list(capped.turns(one))
    assert [(a["turn"], a["final"], s.status) for s, a in truncated] == [(0, True, Status.TRUNCATED)]


def test_a_request_the_trainer_could_not_replay_fails_before_anything_is_sent(engine):
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS)
    with pytest.raises(ConfigError, match="top_p"):
        next(made.turns(PromptGroup("p-2", 0, [5], 1, sampling={"top_p": 5.0})))
    untruncated = HttpPromptEngine(engine.url, sampling={"temperature": 1.0})
    with pytest.raises(ConfigError, match="truncate nothing"):
        next(untruncated.turns(PromptGroup("p-3", 0, [5], 1)))
    assert engine.requests == []


def test_a_sample_whose_engine_dies_or_aborts_is_made_again_alone_and_its_siblings_kept(engine, caplog):
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, timeout_s=10)
    engine.die_next(1)  # sample 0's first call
    sent = [(s.index, a["attempt"], a["final"]) for s, a in made.turns(PROMPT)]
    assert sent == [(6, 1, True), (7, 0, True)] and len(engine.requests) == 3
    assert "episode 0 of prompt group p-7" in caplog.text and "re-sampled alone as attempt 1" in caplog.text
    engine.die_next(2)  # sample 0 fails twice, then is made
    assert [(s.index, a["attempt"]) for s, a in made.turns(PROMPT)] == [(6, 2), (7, 0)]


def test_a_sample_that_fails_every_try_fails_the_group_and_sends_no_final(engine):
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, timeout_s=10, sample_retries=1)
    engine.answer("/generate", fixture("generate_aborted_empty"))
    sent = []
    with pytest.raises(SampleFailed, match=r"episode 0 of prompt group p-7 .*failed on each of its 2 tries \(last: "
                                           r".*aborted turn 0"):
        for sample, args in made.turns(PROMPT):
            sent.append(args)
    assert sent == [] and len(engine.requests) == 2


def test_a_4xx_fails_the_group_at_once(engine):
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, timeout_s=10)
    engine.answer("/generate", fixture("error_400_untruncated"), status=400)
    with pytest.raises(EngineRefused, match=r"answered 400") as refused:
        list(made.turns(PROMPT))
    assert refused.value.status == 400 and len(engine.requests) == 1  # not retried: the request is wrong


@pytest.mark.parametrize("plugins, message", [
    ({"env_factory": prompt_plugins.raising_env}, "environment tests.prompt_plugins:raising_env raised on episode 0 of "
     "prompt group p-7 (group_index 3, index 6): RuntimeError: tool server unreachable"),
    ({"reward_fn": prompt_plugins.raising_reward}, "reward function tests.prompt_plugins:raising_reward raised on "
     "episode 0 of prompt group p-7"),
    ({"reward_fn": prompt_plugins.text}, "returned 'great' on episode 0 of prompt group p-7"),
])
def test_a_plugin_that_raises_stops_the_episode_before_its_final_turn_is_sent(engine, plugins, message):
    completing(engine)
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, **plugins)
    sent = []
    with pytest.raises(PluginFailed) as failed:
        for sample, args in made.turns(PROMPT):
            sent.append(args)
    assert message in str(failed.value)
    assert not any(args["final"] for args in sent)


def _published(turns: list[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
    """The records and publish kwargs, in turn order: the environment's answer (``observation``) is noted, not sent."""
    return sorted(((value, {k: v for k, v in args.items() if k != "observation"}) for value, args in turns),
                  key=lambda r: (r[1]["turn"], r[0]))


def test_a_resumed_episode_continues_from_its_logged_turns_without_asking_the_engine_or_running_their_tools(
        engine, caplog):
    """The built-in tool env: episode 0 of this prompt has two observations (three turns). Two of its turns on the
    log: the engine is asked for the third only, the tool call between them is given back from the log (not run),
    and what the resumed group yields is the undisturbed group, byte for byte. With the answer after the second
    noted with it (its mark's ``observation``, which every turn's kwargs carry), no tool call runs at all."""
    import logging

    from rollout_bus.producers.resume_plan import Logged
    from rollout_bus.wire.codec import decode_samples, encode_samples
    from rollout_bus.wire.episode_record import TURN_FIELDS

    completing(engine)
    prompt = PromptGroup("p-tools-1", 0, [5, 6, 7], 2, metadata={"vocab_size": 50})
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS, env_factory=load_env("rollout_bus.sim.environment:tool_env"),
                            reward_fn=load_reward("tests.prompt_plugins:response_length"), max_turns=6)
    with caplog.at_level(logging.INFO, logger="rollout_bus.sim.environment"):
        undisturbed = [(encode_samples([s], TURN_FIELDS), a) for s, a in made.turns(prompt)]
        ran_undisturbed = sum("tool call executed: prompt group p-tools-1 episode 0" in m for m in caplog.messages)
    episode_0 = [(value, a) for value, a in undisturbed if a["turn"] >= 0 and decode_samples(value, TURN_FIELDS)[0][0]
                 .index == 0]
    assert len(episode_0) == 3 and ran_undisturbed == 2, "the test's premise: three turns, two tool calls"
    asked = len(engine.requests)
    logged = {0: Logged(0, tuple(decode_samples(value, TURN_FIELDS)[0][0] for value, _ in episode_0[:2]), False)}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rollout_bus.sim.environment"):
        resumed = [(encode_samples([s], TURN_FIELDS), a) for s, a in made.turns(prompt, logged)]
        ran = sum("tool call executed: prompt group p-tools-1 episode 0" in m for m in caplog.messages)
    assert _published(resumed) == _published(undisturbed)
    assert len(engine.requests) - asked == asked - 2  # every call again but the two logged turns
    assert ran == 1  # the step between the logged turns came back from the log; the step after them ran again
    answers = [a.get("observation") for _, a in episode_0]
    assert answers[0] and answers[1] and answers[2] is None  # the environment's answer after each turn but the last
    noted = {0: Logged(0, logged[0].turns, False, tuple(answers[1]))}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rollout_bus.sim.environment"):
        resumed = [(encode_samples([s], TURN_FIELDS), a) for s, a in made.turns(prompt, noted)]
        ran = sum("tool call executed: prompt group p-tools-1 episode 0" in m for m in caplog.messages)
    assert _published(resumed) == _published(undisturbed) and ran == 0  # the answer after the last came back too
    finished = {0: Logged(0, tuple(decode_samples(value, TURN_FIELDS)[0][0] for value, _ in episode_0), True)}
    before = len(engine.requests)
    again = [(encode_samples([s], TURN_FIELDS), a) for s, a in made.turns(prompt, finished)]
    assert _published(again) == _published(undisturbed)
    assert len(engine.requests) - before == asked - 3  # a finished episode asks nothing


def _cut(answer: dict, keep: int) -> dict:
    """``answer`` as an engine that was cut (``abort``) after its first ``keep`` output tokens."""
    cut = copy.deepcopy(answer)
    meta = cut["meta_info"]
    cut["output_ids"] = cut["output_ids"][:keep]
    meta["output_token_sampling_mask"] = meta["output_token_sampling_mask"][:keep]
    meta["output_token_sampling_logprobs"] = meta["output_token_sampling_logprobs"][:keep]
    meta["output_token_sampling_mask_length"] = keep
    meta["completion_tokens"] = keep
    meta["finish_reason"] = {"type": "abort", "message": "weight update"}
    return cut


def _rest(answer: dict, keep: int) -> dict:
    """The rest of ``answer`` after its first ``keep`` output tokens, as the continuation call's answer."""
    rest = copy.deepcopy(answer)
    meta = rest["meta_info"]
    rest["output_ids"] = rest["output_ids"][keep:]
    meta["output_token_sampling_mask"] = meta["output_token_sampling_mask"][keep:]
    meta["output_token_sampling_logprobs"] = meta["output_token_sampling_logprobs"][keep:]
    meta["output_token_sampling_mask_length"] = len(rest["output_ids"])
    meta["completion_tokens"] = len(rest["output_ids"])
    return rest


def test_a_turn_cut_mid_way_is_sent_as_its_part_and_continued_with_the_tokens_it_has_left(engine):
    whole = fixture("generate_mask_only")  # three tokens, to max_new_tokens (TRUNCATED)
    engine.answer_next("/generate", _cut(whole, 1), _rest(whole, 1))
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS)
    turns = list(made.turns(PromptGroup("p-cut", 0, [5, 6, 7], 1)))
    assert [(a["turn"], a["final"], s.status) for s, a in turns] == [(0, False, Status.ABORTED),
                                                                     (1, True, Status.TRUNCATED)]
    (cut, _), (rest, _) = turns
    assert list(cut.tokens) == [5, 6, 7, OUTPUT[0]] and list(rest.tokens) == [5, 6, 7, *OUTPUT]
    bodies = [body for _, body in engine.requests]
    assert bodies[1]["input_ids"] == [5, 6, 7, OUTPUT[0]] and bodies[1]["sampling_params"]["max_new_tokens"] == 2
    [episode] = merge_samples([cut, rest])  # one segment: the same turn as if it had never been cut
    engine.requests.clear()
    [(uncut, _)] = list(made.turns(PromptGroup("p-cut", 0, [5, 6, 7], 1)))
    assert list(episode.tokens) == list(uncut.tokens) and episode.response_length == 3
    assert episode.rollout_sampling_mask == uncut.rollout_sampling_mask
    assert np.allclose(episode.rollout_log_probs, uncut.rollout_log_probs)


def test_an_episode_resumed_after_a_cut_part_continues_that_turn(engine):
    from rollout_bus.producers.resume_plan import Logged

    whole = fixture("generate_mask_only")
    engine.answer_next("/generate", _cut(whole, 1))
    made = HttpPromptEngine(engine.url, sampling=DEFAULTS)
    prompt = PromptGroup("p-cut", 0, [5, 6, 7], 1)
    [(cut, args)] = [pair for pair, _ in zip(made.turns(prompt), range(1))]  # the member died after the cut part
    assert cut.status is Status.ABORTED and not args["final"]
    engine.answer_next("/generate", _rest(whole, 1))
    turns = list(made.turns(prompt, {0: Logged(0, (cut,), False)}))
    assert [(a["turn"], a["final"]) for _, a in turns] == [(0, False), (1, True)] and turns[0][0] is cut
    assert engine.requests[-1][1]["input_ids"] == [5, 6, 7, OUTPUT[0]]
    assert engine.requests[-1][1]["sampling_params"]["max_new_tokens"] == 2
