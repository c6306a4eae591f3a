"""Sample, Status and AdapterRef: defaults, validation, stripping and retry."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask

FIELD_ORDER = [
    "group_index", "index", "rollout_id", "prompt", "tokens", "response", "response_length", "label", "reward",
    "loss_mask", "weight_versions", "rollout_log_probs", "rollout_sampling_mask", "remove_sample", "status",
    "metadata", "adapter", "rollout_token_versions",  # miles' fields, then rollout-bus's extension
]


def full_sample(**overrides) -> Sample:
    values = dict(
        group_index=1, index=7, rollout_id=70, prompt="p", tokens=[1, 2, 3, 4, 5], response="r",
        response_length=3, label="L", reward=1.0, loss_mask=[1, 0, 1], weight_versions=["3", "5"],
        rollout_log_probs=[-0.1, 0.0, -0.3], rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[3, 9], [4], [5]]),
        remove_sample=False, status=Status.COMPLETED, metadata={"k": 1}, adapter=AdapterRef("math", 2),
    )
    values.update(overrides)
    return Sample(**values)


def test_adapter_ref_is_frozen_and_hashable():
    ref = AdapterRef(name="math", slot=2)
    assert ref == AdapterRef("math", 2) and hash(ref) == hash(AdapterRef("math", 2))
    assert {ref: 1}[AdapterRef("math", 2)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.slot = 3


def test_status_is_a_string_enum_with_lowercase_values():
    assert [s.value for s in Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    assert Status.COMPLETED == "completed" and Status("aborted") is Status.ABORTED


def test_sample_fields_come_in_contract_order_with_contract_defaults():
    assert [f.name for f in dataclasses.fields(Sample)] == FIELD_ORDER
    sample = Sample()
    assert sample.tokens == [] and sample.response == "" and sample.response_length == 0
    assert sample.prompt == "" and sample.weight_versions == [] and sample.metadata == {}
    assert sample.loss_mask is None and sample.rollout_log_probs is None and sample.rollout_sampling_mask is None
    assert sample.status is Status.PENDING and sample.adapter is None and sample.remove_sample is False
    assert Sample().metadata is not sample.metadata  # no shared mutable defaults


def test_a_status_string_is_coerced_and_an_unknown_one_raises():
    assert Sample(status="truncated").status is Status.TRUNCATED
    with pytest.raises(ContractError, match="'status'"):
        Sample(status="done")


def test_token_fields_may_be_numpy_arrays_and_compare_equal_to_lists():
    arrays = full_sample(tokens=np.arange(1, 6), loss_mask=np.array([1, 0, 1], np.uint8),
                         rollout_log_probs=np.array([-0.1, 0.0, -0.3]))
    arrays.validate()
    assert arrays == full_sample()
    assert arrays != full_sample(tokens=[1, 2, 3, 4, 6])
    assert full_sample(rollout_log_probs=None) != full_sample()
    assert full_sample(reward=2.0) != full_sample()


def test_effective_response_length_sums_the_loss_mask_or_falls_back_to_response_length():
    assert full_sample().effective_response_length == 2
    assert full_sample(loss_mask=np.array([1, 1, 1], np.uint8)).effective_response_length == 3
    assert full_sample(loss_mask=None).effective_response_length == 3


@pytest.mark.parametrize(
    ("versions", "expected"),
    [(["3", "5", "12"], 3), (["12", "abc", "4"], 4), (["v1", ""], None), ([], None), (["007"], 7)],
)
def test_oldest_weight_version_is_the_smallest_all_digit_version(versions, expected):
    assert Sample(weight_versions=versions).oldest_weight_version == expected


def test_a_consistent_sample_validates():
    full_sample().validate()
    Sample().validate()
    full_sample(loss_mask=None, rollout_log_probs=None, rollout_sampling_mask=None).validate()


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"response_length": -1}, "'response_length' must be >= 0 (got -1)"),
        ({"response_length": 6}, "'len(tokens)' must be >= response_length=6 (got 5)"),
        ({"loss_mask": [1, 1]}, "'len(loss_mask)' must be response_length=3 (got 2)"),
        ({"rollout_log_probs": [0.0] * 4}, "'len(rollout_log_probs)' must be response_length=3 (got 4)"),
        ({"rollout_sampling_mask": RolloutSamplingMask.from_mask_list([[1]])},
         "'len(rollout_sampling_mask)' must be response_length=3 (got 1)"),
        ({"rollout_sampling_mask": [[1], [2], [3]]}, "'rollout_sampling_mask' must be a RolloutSamplingMask"),
        ({"response_length": 2.0}, "'response_length' must be an integer"),
    ],
)
def test_validate_raises_a_value_error_naming_the_field_and_both_lengths(overrides, pattern):
    with pytest.raises(ValueError) as info:
        full_sample(**overrides).validate()
    assert isinstance(info.value, ContractError)
    assert pattern in str(info.value)
    assert "index=7" in str(info.value)


def test_worked_example_stripping_two_forced_tokens_leaves_the_sampled_token():
    mask = RolloutSamplingMask([10, 4, 20, 21], [0, 2, 3, 4])
    sample = Sample(tokens=[1, 2, 30, 20, 21], response_length=3, rollout_sampling_mask=mask,
                    loss_mask=[1, 0, 0], rollout_log_probs=[-0.5, 0.0, 0.0])
    sample.strip_last_output_tokens(2)
    ids, offsets = sample.rollout_sampling_mask.as_arrays()
    assert ids.tolist() == [10, 4] and offsets.tolist() == [0, 2]
    assert sample.tokens == [1, 2, 30] and sample.response_length == 1
    assert sample.loss_mask == [1] and sample.rollout_log_probs == [-0.5]
    sample.validate()


def test_strip_keeps_numpy_fields_aligned():
    sample = full_sample(tokens=np.arange(1, 6), loss_mask=np.array([1, 0, 1]))
    sample.strip_last_output_tokens(3)
    assert list(sample.tokens) == [1, 2] and sample.response_length == 0
    assert list(sample.loss_mask) == [] and len(sample.rollout_sampling_mask) == 0
    sample.validate()


@pytest.mark.parametrize("n", [0, -2])
def test_strip_of_zero_or_fewer_tokens_changes_nothing(n):
    sample = full_sample()
    sample.strip_last_output_tokens(n)
    assert sample == full_sample()


def test_strip_of_more_tokens_than_the_response_raises_and_changes_nothing():
    sample = full_sample()
    with pytest.raises(ContractError, match="response_length=3"):
        sample.strip_last_output_tokens(4)
    assert sample == full_sample()


def test_strip_re_decodes_the_response_when_given_a_tokenizer():
    class Tokenizer:
        def decode(self, ids):
            return ",".join(map(str, ids))

    sample = full_sample()
    sample.strip_last_output_tokens(1, tokenizer=Tokenizer())
    assert sample.response == "3,4"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=4), max_size=12), st.data())
def test_strip_matches_slicing_every_per_token_field(rows, data):
    n = data.draw(st.integers(-1, len(rows)))
    prompt = [7, 7]
    tokens = prompt + [row[0] for row in rows]
    sample = Sample(tokens=tokens, response_length=len(rows), loss_mask=[i % 2 for i in range(len(rows))],
                    rollout_log_probs=[-float(i) for i in range(len(rows))],
                    rollout_sampling_mask=RolloutSamplingMask.from_mask_list(rows))
    sample.strip_last_output_tokens(n)
    keep = len(rows) - max(n, 0)
    assert sample.response_length == keep and sample.tokens == tokens[: len(prompt) + keep]
    assert sample.loss_mask == [i % 2 for i in range(keep)]
    assert sample.rollout_log_probs == [-float(i) for i in range(keep)]
    assert sample.rollout_sampling_mask == RolloutSamplingMask.from_mask_list(rows[:keep])


def test_reset_for_retry_keeps_identity_prompt_label_metadata_and_clears_the_rest():
    sample = full_sample(remove_sample=True)
    sample.reset_for_retry()
    assert (sample.group_index, sample.index, sample.rollout_id, sample.adapter) == (1, 7, 70, AdapterRef("math", 2))
    assert sample.prompt == "p" and sample.label == "L" and sample.metadata == {"k": 1}
    assert sample.tokens == [] and sample.response == "" and sample.response_length == 0
    assert sample.reward is None and sample.loss_mask is None and sample.weight_versions == []
    assert sample.rollout_log_probs is None and sample.rollout_sampling_mask is None
    assert sample.remove_sample is False and sample.status is Status.ABORTED
    sample.validate()
