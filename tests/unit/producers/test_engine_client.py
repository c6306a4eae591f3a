"""The engine client against a local server that answers in SGLang's shapes: requests carry only what the
trainer can replay, every answer shape publishes a turn, refusals and a dying engine publish nothing."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ConfigError, EngineError
from rollout_bus.model.sample import Sample, Status
from rollout_bus.producers.engine_client import EngineClient, publish_from_engine
from rollout_bus.producers.engine_request import chat_request, check_sampling_params, generate_request
from tests.engine_server import DIE, FixtureEngine, fixture

TEMPLATE = Sample(group_index=0, index=1, rollout_id=1, prompt="capital?")
PARAMS = {"temperature": 1.0, "top_p": 0.8, "top_k": -1, "max_new_tokens": 3}


class Turns:
    """A publisher that keeps what it is given."""

    def __init__(self):
        self.sent = []

    def publish_turn(self, sample, **kwargs):
        self.sent.append((sample, kwargs))


@pytest.fixture
def engine():
    with FixtureEngine() as server:
        yield server


def test_a_generate_call_becomes_a_published_turn_and_asks_for_the_supports(engine):
    turns = Turns()
    sample = publish_from_engine(EngineClient(engine.url), turns, template=TEMPLATE, context_tokens=[5, 6, 7],
                                 sampling_params=PARAMS, turn=0, final=True, group_size=4)
    assert turns.sent == [(sample, {"turn": 0, "final": True, "attempt": 0, "group_size": 4})]
    assert list(sample.tokens) == [5, 6, 7, 12095, 13, 576] and sample.status is Status.TRUNCATED
    assert engine.requests == [("/generate", {"input_ids": [5, 6, 7], "sampling_params": PARAMS,
                                              "return_sampling_mask": True})]


def test_a_chat_completion_asks_for_meta_info_and_token_ids(engine):
    answer = EngineClient(engine.url).chat("qwen", [{"role": "user", "content": "Name a capital."}], PARAMS)
    assert answer["choices"][0]["completion_token_ids"] == [52854, 374, 279]
    path, body = engine.requests[0]
    assert path == "/v1/chat/completions" and body["max_tokens"] == 3 and "max_new_tokens" not in body
    assert body["return_sampling_mask"] and body["return_meta_info"] and body["return_completion_token_ids"]


def test_the_engines_400_is_one_line_with_its_message_and_nothing_is_published(engine):
    turns = Turns()
    with pytest.raises(EngineError, match=r"/generate answered 400: return_sampling_mask requires a truncated"):
        EngineClient(engine.url).post("/generate", {"input_ids": [1], "sampling_params": {"top_p": 1.0},
                                                    "return_sampling_mask": True})
    assert turns.sent == []


def test_an_engine_that_dies_mid_request_is_said_and_nothing_is_published(engine):
    turns = Turns()
    with pytest.raises(EngineError, match="did not answer"):
        publish_from_engine(EngineClient(engine.url, timeout_s=10), turns, template=TEMPLATE, context_tokens=DIE,
                            sampling_params=PARAMS, turn=0, final=True, group_size=1)
    assert turns.sent == []


def test_an_answer_that_breaks_the_contract_publishes_nothing(engine):
    bad = fixture("generate_mask_only")
    bad["meta_info"]["output_token_sampling_mask"][1] = [99]  # the sampled token 13 is not in its support
    engine.answer("/generate", bad)
    turns = Turns()
    with pytest.raises(Exception, match="position 1"):
        publish_from_engine(EngineClient(engine.url), turns, template=TEMPLATE, context_tokens=[5],
                            sampling_params=PARAMS, turn=0, final=True, group_size=1)
    assert turns.sent == []


def test_no_engine_at_all_is_an_engine_error():
    with pytest.raises(EngineError, match="did not answer"):
        EngineClient("http://127.0.0.1:9", timeout_s=5).generate([1], PARAMS)


@pytest.mark.parametrize("params, match", [
    ({"top_p": 1.0, "top_k": -1, "min_p": 0.0}, "truncate nothing"),
    ({}, "truncate nothing"),
    ({"top_p": 0.9, "repetition_penalty": 1.1}, "repetition_penalty"),
    ({"top_p": 0.9, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_p": 0.9, "presence_penalty": -0.2}, "presence_penalty"),
    ({"top_p": 0.9, "logit_bias": {"13": 5.0}}, "logit_bias"),
    ({"top_p": 0.9, "custom_logit_processor": "x"}, "custom_logit_processor"),
    ({"top_p": 0.9, "stream": True}, "stream"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.0}, "min_p"),
    ({"top_k": 5, "temperature": 0}, "temperature"),
])
def test_a_request_the_trainer_could_not_replay_is_refused_before_it_is_sent(params, match):
    with pytest.raises(ConfigError, match=match):
        check_sampling_params(params)
    with pytest.raises(ConfigError, match=match):
        generate_request([1], params)
    with pytest.raises(ConfigError, match=match):
        chat_request("m", [], params)


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 1}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.95,
                                    "repetition_penalty": 1.0, "frequency_penalty": 0, "logit_bias": {}}])
def test_any_truncation_with_neutral_penalties_is_allowed(params):
    check_sampling_params(params)
