"""Trainer conversion and DP split (docs/data-model.md section 5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ConfigError, ContractError, MaskCheckError
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.train_data import (
    NON_METRIC_KEYS,
    PER_SAMPLE_KEYS,
    convert_samples_to_train_data,
    split_train_data_by_dp,
)


def make_sample(response_length: int = 3, prompt_length: int = 2, *, mask: bool = False, **fields) -> Sample:
    tokens = list(range(100, 100 + prompt_length + response_length))
    if mask:
        fields["rollout_sampling_mask"] = RolloutSamplingMask.from_mask_list(
            [[t, t + 1] for t in tokens[prompt_length:]]
        )
    fields.setdefault("status", Status.COMPLETED)
    return Sample(tokens=tokens, response_length=response_length, **fields)


def rewards_of(samples, **kwargs) -> list[float]:
    return convert_samples_to_train_data(samples, **kwargs)["rewards"]


# ---------------------------------------------------------------------------- conversion


def test_conversion_produces_every_contract_key_per_sample():
    samples = [make_sample(group_index=0, index=i, reward=1.0) for i in range(3)]
    data = convert_samples_to_train_data(samples)
    for key in ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "sample_indices",
                "rollout_ids", "loss_masks", "group_indices", "adapter_slots"):
        assert len(data[key]) == 3, key
    assert "rollout_log_probs" not in data
    assert "rollout_sampling_mask_ids" not in data
    assert data["tokens"][0].dtype == np.int32
    assert list(data["tokens"][1]) == samples[1].tokens


def test_loss_mask_none_becomes_ones_and_remove_sample_becomes_zeros():
    samples = [
        make_sample(4, index=0, loss_mask=None),
        make_sample(4, index=1, loss_mask=[1, 0, 1, 0], remove_sample=True),
        make_sample(2, index=2, loss_mask=[0, 1]),
    ]
    masks = convert_samples_to_train_data(samples)["loss_masks"]
    assert [m.tolist() for m in masks] == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 1]]
    assert all(m.dtype == np.uint8 for m in masks)


def test_loss_mask_values_other_than_zero_and_one_are_rejected():
    with pytest.raises(ContractError, match="loss_mask"):
        convert_samples_to_train_data([make_sample(2, loss_mask=[1, 2])])


def test_rollout_ids_fall_back_to_the_sample_index_and_missing_ids_are_minus_one():
    samples = [make_sample(index=4, rollout_id=9), make_sample(index=5), make_sample(adapter=AdapterRef("a", 2))]
    data = convert_samples_to_train_data(samples)
    assert data["rollout_ids"] == [9, 5, -1]
    assert data["sample_indices"] == [4, 5, -1]
    assert data["group_indices"] == [-1, -1, -1]
    assert data["adapter_slots"] == [-1, -1, 2]


def test_truncated_marks_only_truncated_status():
    samples = [make_sample(status=s) for s in (Status.TRUNCATED, Status.COMPLETED, Status.ABORTED)]
    assert convert_samples_to_train_data(samples)["truncated"] == [1, 0, 0]


def test_rollout_log_probs_are_kept_as_float32_when_every_sample_has_them():
    samples = [make_sample(2, rollout_log_probs=[-0.5, -1.5]), make_sample(1, rollout_log_probs=[0.0])]
    data = convert_samples_to_train_data(samples)
    assert [lp.tolist() for lp in data["rollout_log_probs"]] == [[-0.5, -1.5], [0.0]]
    assert data["rollout_log_probs"][0].dtype == np.float32


def test_rollout_log_probs_on_only_some_samples_is_an_error_naming_the_position():
    samples = [make_sample(2, rollout_log_probs=[-0.5, -1.5]), make_sample(1, index=7)]
    with pytest.raises(ContractError, match=r"rollout_log_probs.*position=1, sample_index=7"):
        convert_samples_to_train_data(samples)


def test_a_sample_whose_lengths_disagree_is_rejected_with_its_position():
    bad = make_sample(3, loss_mask=[1, 1])
    with pytest.raises(ContractError, match=r"loss_mask.*batch position=1"):
        convert_samples_to_train_data([make_sample(), bad])


def test_tokens_that_do_not_fit_int32_are_rejected():
    sample = Sample(tokens=[1, 2**31], response_length=1, status=Status.COMPLETED)
    with pytest.raises(ContractError, match="int32"):
        convert_samples_to_train_data([sample])


def test_empty_batch_converts_to_empty_lists():
    data = convert_samples_to_train_data([])
    assert data["tokens"] == [] and data["rewards"] == []


# ---------------------------------------------------------------------------- mask check


def test_masks_travel_as_int32_ids_and_int64_offsets_per_sample():
    samples = [make_sample(2, mask=True), make_sample(3, mask=True)]
    data = convert_samples_to_train_data(samples)
    ids, offsets = samples[1].rollout_sampling_mask.as_arrays()
    assert data["rollout_sampling_mask_ids"][1].dtype == np.int32
    assert data["rollout_sampling_mask_offsets"][1].dtype == np.int64
    np.testing.assert_array_equal(data["rollout_sampling_mask_ids"][1], ids)
    np.testing.assert_array_equal(data["rollout_sampling_mask_offsets"][1], offsets)


def test_one_sample_without_a_mask_fails_the_whole_batch_with_the_exact_message():
    samples = [
        make_sample(mask=True, index=10),
        make_sample(mask=True, index=11),
        make_sample(index=12, status=Status.TRUNCATED),
        make_sample(index=13),
    ]
    expected = (
        "sampling-mask data must be present for every training sample; "
        "missing at position=2, sample_index=12, status=truncated"
    )
    with pytest.raises(ValueError) as info:
        convert_samples_to_train_data(samples)
    assert isinstance(info.value, MaskCheckError)
    assert str(info.value) == expected


def test_remove_sample_does_not_exempt_a_sample_from_the_mask_check():
    samples = [make_sample(mask=True), make_sample(index=3, remove_sample=True)]
    with pytest.raises(MaskCheckError, match="position=1, sample_index=3, status=completed"):
        convert_samples_to_train_data(samples)


def test_the_mask_check_names_the_first_missing_sample_even_when_the_first_sample_lacks_one():
    samples = [make_sample(index=None, status=Status.ABORTED), make_sample(mask=True)]
    with pytest.raises(MaskCheckError, match=r"position=0, sample_index=None, status=aborted$"):
        convert_samples_to_train_data(samples)


# ---------------------------------------------------------------------------- rewards


def test_raw_reward_selects_the_reward_key_and_is_nan_when_not_numeric():
    samples = [
        make_sample(reward={"score": 2.0, "detail": "x"}),
        make_sample(reward={"other": 1.0}),
        make_sample(reward=None),
        make_sample(reward="high"),
        make_sample(reward=3),
    ]
    raw = convert_samples_to_train_data(samples, reward_key="score", normalization="none")["raw_reward"]
    assert raw[0] == 2.0 and raw[4] == 3.0
    assert all(math.isnan(r) for r in raw[1:4])


def test_a_dict_reward_without_a_reward_key_is_not_numeric():
    raw = convert_samples_to_train_data([make_sample(reward={"score": 1.0})])["raw_reward"]
    assert math.isnan(raw[0])


def test_none_normalization_keeps_rewards_and_zeroes_non_numeric_ones():
    samples = [make_sample(index=0, reward=2.5), make_sample(index=1, reward=None)]
    assert rewards_of(samples, normalization="none") == [2.5, 0.0]


def test_grpo_subtracts_the_group_mean_per_prompt_group():
    samples = [
        make_sample(group_index=0, index=0, reward=0.0),
        make_sample(group_index=1, index=2, reward=10.0),
        make_sample(group_index=0, index=1, reward=2.0),
        make_sample(group_index=1, index=3, reward=14.0),
    ]
    assert rewards_of(samples) == pytest.approx([-1.0, -2.0, 1.0, 2.0])


def test_groups_are_per_adapter_even_with_the_same_group_index():
    a, b = AdapterRef("a", 0), AdapterRef("b", 1)
    samples = [
        make_sample(group_index=0, index=0, adapter=a, reward=0.0),
        make_sample(group_index=0, index=1, adapter=a, reward=2.0),
        make_sample(group_index=0, index=0, adapter=b, reward=10.0),
        make_sample(group_index=0, index=1, adapter=b, reward=14.0),
    ]
    assert rewards_of(samples) == pytest.approx([-1.0, 1.0, -2.0, 2.0])


def test_grpo_normalises_over_rollouts_not_rows_and_broadcasts_to_siblings():
    samples = [
        make_sample(group_index=0, index=0, rollout_id=10, reward=0.0),
        make_sample(group_index=0, index=1, rollout_id=11, reward=1.0),
        make_sample(group_index=0, index=1, rollout_id=11, reward=1.0),
        make_sample(group_index=0, index=1, rollout_id=11, reward=1.0),
    ]
    # row mean would be 0.75; the rollout mean is 0.5
    assert rewards_of(samples) == pytest.approx([-0.5, 0.5, 0.5, 0.5])


def test_grpo_std_divides_by_the_sample_std_of_rollout_rewards():
    samples = [
        make_sample(group_index=0, rollout_id=10, reward=0.0),
        make_sample(group_index=0, rollout_id=11, reward=1.0),
        make_sample(group_index=0, rollout_id=11, reward=1.0),
    ]
    # rollout rewards [0, 1]: mean 0.5, sample std sqrt(0.5)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert rewards_of(samples, normalization="grpo_std") == pytest.approx([-expected, expected, expected], abs=1e-9)


def test_grpo_std_leaves_a_single_rollout_group_centred_only():
    samples = [
        make_sample(group_index=0, rollout_id=1, reward=3.0),
        make_sample(group_index=0, rollout_id=1, reward=3.0),
        make_sample(group_index=1, rollout_id=2, reward=5.0),
        make_sample(group_index=1, rollout_id=3, reward=5.0),
    ]
    # group 0: one rollout; group 1: std 0, so no division either
    assert rewards_of(samples, normalization="grpo_std") == [0.0, 0.0, 0.0, 0.0]


def test_non_numeric_rewards_give_zero_and_stay_out_of_the_group_mean():
    samples = [
        make_sample(group_index=0, index=0, reward=1.0),
        make_sample(group_index=0, index=1, reward=3.0),
        make_sample(group_index=0, index=2, reward=None),
        make_sample(group_index=0, index=3, reward=float("nan")),
    ]
    assert rewards_of(samples) == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    assert rewards_of(samples, normalization="grpo_std")[2:] == [0.0, 0.0]


def test_siblings_with_different_rewards_are_an_error_naming_the_rollout_and_rows():
    samples = [
        make_sample(group_index=0, index=0, rollout_id=10, reward=0.0),
        make_sample(group_index=0, index=1, rollout_id=11, reward=2.0),
        make_sample(group_index=0, index=1, rollout_id=11, reward=6.0),
    ]
    with pytest.raises(ContractError, match=r"rollout \(None, 'rollout', 0, 11\).*\[2\.0, 6\.0\].*rows \[1, 2\]"):
        convert_samples_to_train_data(samples)


def test_siblings_must_share_the_selected_reward_not_the_whole_dict():
    samples = [
        make_sample(group_index=0, rollout_id=10, reward={"score": 2.0, "detail": "first"}),
        make_sample(group_index=0, rollout_id=10, reward={"score": 2.0, "detail": "second"}),
        make_sample(group_index=0, rollout_id=11, reward={"score": 6.0}),
    ]
    assert rewards_of(samples, reward_key="score") == pytest.approx([-2.0, -2.0, 2.0])


def test_rows_without_any_rollout_identity_are_separate_rollouts():
    samples = [make_sample(group_index=0, reward=0.0), make_sample(group_index=0, reward=2.0)]
    assert rewards_of(samples) == pytest.approx([-1.0, 1.0])


def test_an_unknown_normalization_is_a_config_error_listing_the_allowed_values():
    with pytest.raises(ConfigError, match="none, grpo, grpo_std"):
        convert_samples_to_train_data([make_sample()], normalization="ppo")


# ---------------------------------------------------------------------------- DP split


def lengths_batch(lengths: list[int]) -> dict:
    return {
        "tokens": [np.zeros(n, np.int32) for n in lengths],
        "rewards": [float(i) for i in range(len(lengths))],
        "dynamic_global_batch_size": 7,
    }


def test_split_restricts_per_sample_keys_and_copies_shared_keys():
    data = convert_samples_to_train_data([make_sample(r, index=r, reward=float(r)) for r in range(1, 6)])
    data["step_slots"] = [0, 1]
    ranks = split_train_data_by_dp(data, 2)
    assert sorted(p for r in ranks for p in r["partition"]) == [0, 1, 2, 3, 4]
    for rank in ranks:
        assert rank["step_slots"] is data["step_slots"]
        assert rank["sample_indices"] == [data["sample_indices"][p] for p in rank["partition"]]
        assert [len(t) for t in rank["tokens"]] == [len(data["tokens"][p]) for p in rank["partition"]]
        assert rank["partition"] == sorted(rank["partition"])


def test_split_balances_token_length_better_than_round_robin():
    ranks = split_train_data_by_dp(lengths_batch([10, 11, 12, 13, 14]), 2)
    loads = sorted(sum(len(t) for t in r["tokens"]) for r in ranks)
    assert loads == [27, 33]  # the best split with counts 2 and 3


def test_split_is_deterministic():
    data = lengths_batch([5, 5, 5, 3, 3, 9, 1, 0, 0, 7])
    assert [r["partition"] for r in split_train_data_by_dp(data, 3)] == [
        r["partition"] for r in split_train_data_by_dp(data, 3)
    ]


def test_split_with_more_ranks_than_samples_leaves_empty_ranks():
    ranks = split_train_data_by_dp(lengths_batch([4, 2]), 4)
    assert [len(r["partition"]) for r in ranks].count(0) == 2
    assert all(r["tokens"] == [] for r in ranks if not r["partition"])


def test_splitting_split_data_keeps_original_batch_positions():
    first = split_train_data_by_dp(lengths_batch([1, 2, 3, 4, 5, 6]), 2)
    second = split_train_data_by_dp(first[0], 2)
    assert sorted(p for r in second for p in r["partition"]) == first[0]["partition"]


@pytest.mark.parametrize("dp_size", [0, -1, 1.5, True])
def test_split_rejects_a_dp_size_below_one_or_not_an_integer(dp_size):
    with pytest.raises(ConfigError, match="dp_size"):
        split_train_data_by_dp(lengths_batch([1, 2]), dp_size)


def test_split_rejects_per_sample_keys_of_the_wrong_length():
    data = lengths_batch([1, 2, 3])
    data["rewards"] = [0.0]
    with pytest.raises(ContractError, match="rewards"):
        split_train_data_by_dp(data, 2)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=2000), min_size=0, max_size=60),
    dp_size=st.integers(min_value=1, max_value=9),
)
def test_split_covers_every_sample_once_with_balanced_counts_and_tokens(lengths, dp_size):
    ranks = split_train_data_by_dp(lengths_batch(lengths), dp_size)
    assert len(ranks) == dp_size
    positions = [p for r in ranks for p in r["partition"]]
    assert sorted(positions) == list(range(len(lengths)))
    counts = [len(r["partition"]) for r in ranks]
    assert max(counts) - min(counts) <= 1
    loads = [sum(len(t) for t in r["tokens"]) for r in ranks]
    assert max(loads) - min(loads) <= max(lengths, default=0)
    for rank in ranks:
        assert rank["rewards"] == [float(p) for p in rank["partition"]]


# ---------------------------------------------------------------------------- logging keys


def test_non_metric_keys_cover_ids_masks_and_csr_arrays_but_not_rewards():
    for key in ("tokens", "tokens_offsets", "loss_masks", "rollout_sampling_mask_ids",
                "rollout_sampling_mask_offsets", "sample_indices", "rollout_ids", "group_indices",
                "adapter_slots", "partition"):
        assert key in NON_METRIC_KEYS
    for key in ("rewards", "raw_reward", "response_lengths", "truncated"):
        assert key not in NON_METRIC_KEYS
    assert set(PER_SAMPLE_KEYS) - {"rewards", "raw_reward", "response_lengths", "truncated",
                                   "rollout_log_probs"} <= NON_METRIC_KEYS
