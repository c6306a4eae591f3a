"""One rule decides which rewards count, and the metrics and the trainer conversion both follow it;
weight versions are numeric only as ASCII digits; a batch holding a non-Sample is refused by position."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout_bus.errors import ContractError
from rollout_bus.model.metrics import EpisodeStats, compute_metrics_from_samples, compute_training_sample_metrics
from rollout_bus.model.sample import Sample, Status, reward_number
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.train_data import convert_samples_to_train_data

REWARDS = [
    pytest.param(None, None, id="none"),
    pytest.param("x", None, id="string"),
    pytest.param({}, None, id="dict"),
    pytest.param(True, 1, id="bool"),
    pytest.param(np.bool_(True), 1, id="numpy-bool-true"),
    pytest.param(np.bool_(False), 0, id="numpy-bool-false"),
    pytest.param(math.nan, None, id="nan"),
    pytest.param(math.inf, None, id="inf"),
    pytest.param(-math.inf, None, id="minus-inf"),
    pytest.param(np.float32(1.5), 1.5, id="numpy-float32"),
    pytest.param(np.float64(np.nan), None, id="numpy-nan"),
    pytest.param(np.int64(2), 2, id="numpy-int64"),
    pytest.param(3, 3, id="int"),
    pytest.param(10**400, None, id="int-beyond-float"),
]


def _sample(index: int, reward) -> Sample:
    return Sample(group_index=0, index=index, tokens=[1, 2, 3], response_length=2, reward=reward,
                  status=Status.COMPLETED)


@pytest.mark.parametrize("reward, counts_as", REWARDS)
def test_the_reward_rule(reward, counts_as):
    assert reward_number(reward) == counts_as


@pytest.mark.parametrize("source", ["reward", "metadata"])
@pytest.mark.parametrize("reward, counts_as", REWARDS)
def test_metrics_and_trainer_conversion_agree_on_which_rollouts_have_a_reward(reward, counts_as, source):
    samples = [_sample(0, reward), _sample(1, 10)]  # one rollout with the reward under test, one with 10
    if source == "metadata":  # the metrics read metadata["raw_reward"] when the first sample has it
        for sample in samples:
            sample.metadata = {"raw_reward": sample.reward}
    metrics = compute_training_sample_metrics(samples)
    stats = EpisodeStats()
    for sample in samples:
        stats.add_episode([sample])
    assert stats.metrics()["episode_raw_reward"] == metrics["episode_raw_reward"]
    data = convert_samples_to_train_data(samples, normalization="grpo")
    if counts_as is None:
        assert metrics["episode_raw_reward"] == 10.0  # the other rollout alone
        assert math.isnan(data["raw_reward"][0]) and data["rewards"] == [0.0, 0.0]
    else:
        assert metrics["episode_raw_reward"] == pytest.approx((counts_as + 10) / 2)
        assert data["raw_reward"][0] == counts_as
        assert data["rewards"] == pytest.approx([(counts_as - 10) / 2, (10 - counts_as) / 2])


@pytest.mark.parametrize("versions, oldest", [
    (["3", "12"], 3), (["²", "7"], 7), (["٣"], None), (["", "abc"], None), (["v1", "0"], 0), ([], None),
])
def test_weight_versions_are_numeric_only_as_ascii_digits(versions, oldest):
    sample = _sample(0, 1.0)
    sample.weight_versions = versions
    assert sample.oldest_weight_version == oldest
    metrics = compute_metrics_from_samples([sample])
    assert metrics.get("weight_version/min") == (None if oldest is None else float(oldest))


@pytest.mark.parametrize("bad, type_name", [(None, "NoneType"), ("sample", "str"), ({"tokens": [1]}, "dict")])
def test_a_batch_holding_something_other_than_a_sample_is_refused_naming_its_position(bad, type_name):
    with pytest.raises(ContractError, match=rf"'sample' must be a Sample \(got '{type_name}'\) at batch position=1"):
        convert_samples_to_train_data([_sample(0, 1.0), bad])


def test_a_lone_none_is_refused_as_a_contract_error_not_an_attribute_error():
    with pytest.raises(ContractError, match=r"got 'NoneType'\) at batch position=0"):
        convert_samples_to_train_data([None])


def test_a_non_sample_is_refused_before_the_whole_batch_mask_check_reads_it():
    masked = _sample(0, 1.0)
    masked.rollout_sampling_mask = RolloutSamplingMask.from_mask_list([[1], [2]])
    with pytest.raises(ContractError, match=r"got 'int'\) at batch position=1"):
        convert_samples_to_train_data([masked, 7])
