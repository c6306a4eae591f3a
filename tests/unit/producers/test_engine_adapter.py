"""Turn samples from SGLang-shaped engine responses: ragged supports, log-probs, checks that name the token."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from rollout_bus.producers.engine_adapter import append_engine_response, turn_from_engine_response
from rollout_bus.wire.codec import decode_samples, encode_samples
from rollout_bus.errors import ContractError
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.turns import append_forced_sampling_tokens, merge_samples

TEMPLATE = Sample(group_index=2, index=9, rollout_id=9, prompt="2+2?", adapter=AdapterRef("math", 0))


def response(tokens, supports, *, native=None, finish="stop", text="ok", version=None) -> dict:
    """What SGLang's /generate returns with return_logprob and return_sampling_mask."""
    meta = {"output_token_logprobs": [(-0.1 * (i + 1), t, None) for i, t in enumerate(tokens)],
            "output_token_sampling_mask": supports, "finish_reason": {"type": finish}}
    if native is not None:
        meta["output_token_sampling_logprobs"] = native
    if version is not None:
        meta["weight_version"] = version
    return {"text": text, "meta_info": meta}


def test_a_response_becomes_a_turn_with_its_ragged_supports_and_native_log_probs():
    native = [math.log(0.6), math.log(1.0), math.log(0.25)]
    sample = turn_from_engine_response(response([10, 11, 12], [[10, 4, 7], [11], [3, 12, 5, 6]], native=native,
                                                version="7"), context_tokens=[1, 2, 3], template=TEMPLATE)
    assert list(sample.tokens) == [1, 2, 3, 10, 11, 12] and sample.response_length == 3
    assert [sample.rollout_sampling_mask.row(t).tolist() for t in range(3)] == [[10, 4, 7], [11], [3, 12, 5, 6]]
    np.testing.assert_allclose(sample.rollout_log_probs, native)
    assert list(sample.loss_mask) == [1, 1, 1] and sample.weight_versions == ["7"]
    assert (sample.group_index, sample.index, sample.rollout_id, sample.adapter) == (2, 9, 9, AdapterRef("math", 0))
    assert sample.status == Status.COMPLETED and sample.response == "ok"


def test_without_native_log_probs_the_token_log_probs_are_used():
    sample = turn_from_engine_response(response([5, 6], [[5], [6, 1]]), context_tokens=[1], template=TEMPLATE)
    np.testing.assert_allclose(sample.rollout_log_probs, [-0.1, -0.2])


def test_a_sampled_token_outside_its_support_is_refused_naming_the_position():
    with pytest.raises(ContractError, match="position 1"):
        turn_from_engine_response(response([5, 6, 7], [[5], [1, 2], [7]]), context_tokens=[1], template=TEMPLATE)


@pytest.mark.parametrize("break_it, match", [
    pytest.param(lambda r: r["meta_info"]["output_token_sampling_mask"].pop(), "output_token_sampling_mask",
                 id="one-support-short"),
    pytest.param(lambda r: r["meta_info"].update(output_token_sampling_logprobs=[-0.1]),
                 "output_token_sampling_logprobs", id="log-probs-short"),
    pytest.param(lambda r: r["meta_info"].pop("output_token_sampling_mask"), "output_token_sampling_mask",
                 id="no-supports"),
    pytest.param(lambda r: r["meta_info"]["output_token_sampling_mask"].__setitem__(0, []), "non-empty",
                 id="empty-support"),
    pytest.param(lambda r: r["meta_info"].pop("output_token_logprobs"), "output_token_logprobs", id="no-tokens"),
    pytest.param(lambda r: r.pop("meta_info"), "meta_info", id="no-meta-info"),
])
def test_malformed_responses_are_refused(break_it, match):
    bad = response([5, 6], [[5], [6, 1]])
    break_it(bad)
    with pytest.raises(ContractError, match=match):
        turn_from_engine_response(bad, context_tokens=[1], template=TEMPLATE)


def test_a_refused_response_leaves_the_sample_unchanged():
    sample = turn_from_engine_response(response([5], [[5]]), context_tokens=[1], template=TEMPLATE)
    before = copy.deepcopy(sample)
    with pytest.raises(ContractError):
        append_engine_response(sample, response([6], [[7]]))
    assert sample == before


def test_finish_reasons_set_the_status():
    length = turn_from_engine_response(response([5], [[5]], finish="length"), context_tokens=[1], template=TEMPLATE)
    aborted = turn_from_engine_response(response([5], [[5]], finish="abort"), context_tokens=[1], template=TEMPLATE)
    assert (length.status, aborted.status) == (Status.TRUNCATED, Status.ABORTED)


def test_a_tool_call_between_two_engine_calls_gets_forced_rows_and_the_turns_merge():
    turn0 = turn_from_engine_response(response([20, 21], [[20, 3], [21]], version="1"), context_tokens=[1, 2],
                                      template=TEMPLATE)
    append_forced_sampling_tokens(turn0, [90, 91])
    turn0.tokens = np.concatenate([turn0.tokens, [90, 91]])
    turn0.response_length += 2
    turn0.loss_mask = np.concatenate([turn0.loss_mask, [0, 0]])
    turn0.rollout_log_probs = np.concatenate([turn0.rollout_log_probs, [0.0, 0.0]])
    append_engine_response(turn0, response([22], [[22, 8]], version="1"))
    turn0.validate()
    assert turn0.weight_versions == ["1", "1"]
    assert [turn0.rollout_sampling_mask.row(t).tolist() for t in range(5)] == [[20, 3], [21], [90], [91], [22, 8]]
    turn1 = turn_from_engine_response(response([30], [[30, 31]], version="2"),
                                      context_tokens=[*turn0.tokens, 50, 51], template=TEMPLATE)
    (episode,) = merge_samples([turn0, turn1])
    assert list(episode.loss_mask) == [1, 1, 0, 0, 1, 0, 0, 1]
    assert episode.weight_versions == ["1", "1", "2"]
    (decoded,), _ = decode_samples(encode_samples([turn1], TURN_FIELDS), TURN_FIELDS)
    assert decoded == turn1


def test_a_response_without_supports_may_be_accepted_when_masks_are_not_required():
    sample = turn_from_engine_response(response([5], None), context_tokens=[1], template=TEMPLATE, require_mask=False)
    assert sample.rollout_sampling_mask is None and sample.response_length == 1
