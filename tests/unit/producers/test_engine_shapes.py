"""Every shape SGLang answers with its native return_sampling_mask (tests/fixtures/sglang) becomes a turn, and
every inconsistency is refused by name and position, the sample unchanged."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import Sample, Status
from rollout_bus.producers.engine_adapter import append_engine_response, engine_output, turn_from_engine_response

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sglang"
TEMPLATE = Sample(group_index=1, index=3, rollout_id=3, prompt="capital?")
CONTEXT = [1, 2, 3]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def turn(response: dict, **kwargs) -> Sample:
    return turn_from_engine_response(response, context_tokens=CONTEXT, template=TEMPLATE, **kwargs)


@pytest.mark.parametrize("name, tokens, status, text", [
    ("generate_mask_only", [12095, 13, 576], Status.TRUNCATED, " Paris."),
    ("generate_mask_and_logprob", [19846, 11, 323], Status.TRUNCATED, " Berlin,"),
    ("chat_completion", [52854, 374, 279], Status.TRUNCATED, "Tokyo is"),
    ("generate_prefill_only", [], Status.TRUNCATED, ""),
    ("generate_aborted_empty", [], Status.ABORTED, ""),
])
def test_each_shape_the_engine_returns_is_a_turn(name, tokens, status, text):
    response = fixture(name)
    sample = turn(response)
    assert list(sample.tokens) == CONTEXT + tokens and sample.response_length == len(tokens)
    assert sample.status is status and sample.response == text
    if tokens:
        meta = _meta(response)
        assert [sample.rollout_sampling_mask.row(t).tolist() for t in range(len(tokens))] == \
            meta["output_token_sampling_mask"]
        np.testing.assert_allclose(sample.rollout_log_probs, meta["output_token_sampling_logprobs"])
    else:
        assert sample.rollout_sampling_mask is None


def test_the_support_renormalised_log_prob_wins_over_return_logprobs():
    sample = turn(fixture("generate_mask_and_logprob"))
    assert list(sample.rollout_log_probs) == [0.0, 0.0, 0.0]  # greedy supports: the whole mass on the token
    assert sample.weight_versions == ["3"] and list(sample.rollout_token_versions) == [3, 3, 3]


def _meta(response):
    """The answer's meta info, found as the adapter finds it (a chat answer's first choice)."""
    return engine_output(response)[1]


BROKEN = [
    ("generate_mask_only", lambda r: r["output_ids"].pop(), "len(meta_info['output_token_sampling_logprobs'])"),
    ("generate_mask_only", lambda r: _meta(r).update(output_token_sampling_mask_length=2),
     "output_token_sampling_mask_length"),
    ("generate_mask_only", lambda r: _meta(r)["output_token_sampling_mask"].__setitem__(2, [1205]), "position 2"),
    ("generate_mask_only", lambda r: _meta(r)["output_token_sampling_logprobs"].__setitem__(1, math.nan),
     "log-prob at position 1"),
    ("generate_mask_only", lambda r: _meta(r)["output_token_sampling_logprobs"].__setitem__(0, 0.5),
     "log-prob at position 0"),
    ("generate_mask_only", lambda r: _meta(r).pop("output_token_sampling_logprobs"), "behaviour log-prob"),
    ("generate_mask_only", lambda r: _meta(r).pop("output_token_sampling_mask"), "output_token_sampling_mask"),
    ("generate_mask_and_logprob", lambda r: _meta(r)["output_token_logprobs"][1].__setitem__(1, 12),
     "output_token_logprobs'] token at position 1"),
    ("chat_completion", lambda r: r["choices"][0].pop("meta_info"), "return_meta_info"),
    ("chat_completion", lambda r: r.update(choices=[]), "choices"),
    ("chat_completion", lambda r: r["choices"][0].__setitem__("completion_token_ids", "52854"), "token ids"),
]


@pytest.mark.parametrize("name, break_it, match", BROKEN, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BROKEN)])
def test_an_inconsistent_response_is_refused_by_name_and_position_and_nothing_is_appended(name, break_it, match):
    sample = turn(fixture("generate_mask_only"))
    before = copy.deepcopy(sample)
    bad = fixture(name)
    break_it(bad)
    with pytest.raises(ContractError, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        append_engine_response(sample, bad)
    assert sample == before


def test_a_call_without_supports_is_refused_once_the_sample_has_them():
    sample = turn(fixture("generate_mask_only"))
    plain = fixture("generate_mask_and_logprob")
    for key in ("output_token_sampling_mask", "output_token_sampling_logprobs", "output_token_sampling_mask_length"):
        _meta(plain).pop(key)
    with pytest.raises(ContractError, match="the sample already has supports"):
        append_engine_response(sample, plain, require_mask=False)


def test_a_multi_call_turn_grows_and_an_aborted_empty_call_only_sets_its_status():
    sample = turn(fixture("generate_mask_only"))
    append_engine_response(sample, fixture("chat_completion"))
    assert sample.response_length == 6 and sample.rollout_sampling_mask.row(5).tolist() == [279]
    append_engine_response(sample, fixture("generate_aborted_empty"))
    assert sample.response_length == 6 and sample.status is Status.ABORTED
    sample.validate()
