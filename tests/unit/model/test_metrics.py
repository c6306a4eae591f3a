"""Batch rollout metrics (docs/data-model.md section 6), checked on hand-made cases and against a naive model."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.metrics import (compute_episode_response_length_metrics, compute_metrics_from_samples,
                                       compute_statistics, compute_training_sample_metrics)
from rollout_bus.model.sample import get_rollout_key
from rollout_bus.model.sample import AdapterRef, Sample, Status

LORA_A = AdapterRef("math", 0)
LORA_B = AdapterRef("code", 1)
LORA_A_OTHER_SLOT = AdapterRef("math", 2)
LENGTH_SUFFIXES = ("mean", "median", "max", "min")


def make(**fields) -> Sample:
    fields.setdefault("response_length", 1)
    return Sample(**fields)


def worked_example() -> list[Sample]:
    return [
        make(group_index=0, rollout_id=10, response_length=5, loss_mask=[1, 1, 0, 0, 0]),
        make(group_index=0, rollout_id=10, response_length=7, loss_mask=[1, 1, 1, 0, 0, 0, 0]),
        make(group_index=0, rollout_id=11, response_length=4, loss_mask=[1, 1, 1, 1]),
        make(group_index=1, rollout_id=10, response_length=8, loss_mask=[1, 1, 1, 1, 1, 1, 0, 0]),
    ]


# --- get_rollout_key and compute_statistics -------------------------------------------------


def test_rollout_key_prefers_rollout_id_then_index_then_position():
    assert get_rollout_key(make(group_index=3, rollout_id=7, index=9), 5) == (None, "rollout", 3, 7)
    assert get_rollout_key(make(group_index=3, index=9), 5) == (None, "sample", 3, 9)
    assert get_rollout_key(make(group_index=3, adapter=LORA_A), 5) == (LORA_A, "position", 3, 5)


def test_statistics_are_floats_and_an_even_count_median_averages_the_middle_pair():
    result = compute_statistics([4, 1, 3, 2])
    assert result == {"mean": 2.5, "median": 2.5, "max": 4.0, "min": 1.0}
    assert all(type(value) is float for value in result.values())


def test_statistics_of_nothing_or_of_text_raise_contract_error():
    with pytest.raises(ContractError):
        compute_statistics([])
    with pytest.raises(ContractError):
        compute_statistics(["3", "4"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(10**6), 10**6), min_size=1, max_size=30))
def test_statistics_match_the_textbook_definitions_on_integers(values):
    result = compute_statistics(values)
    assert result == {
        "mean": float(statistics.mean(values)),
        "median": float(statistics.median(values)),
        "max": float(max(values)),
        "min": float(min(values)),
    }


# --- episode lengths ---------------------------------------------------------------------------


def test_compaction_siblings_are_summed_into_one_episode_before_any_statistic():
    result = compute_episode_response_length_metrics(worked_example())
    assert result == {
        "episode_response_length/mean": 5.0,
        "episode_response_length/median": 5.0,
        "episode_response_length/max": 6.0,
        "episode_response_length/min": 4.0,
        "episode_total_response_length/mean": 8.0,
    }


def test_a_removed_sample_trains_on_no_tokens_but_counts_its_full_length_in_the_total():
    samples = [
        make(group_index=0, rollout_id=1, response_length=5, loss_mask=[1, 1, 1, 0, 0]),
        make(group_index=0, rollout_id=1, response_length=4, remove_sample=True),
    ]
    result = compute_episode_response_length_metrics(samples)
    assert result["episode_response_length/mean"] == 3.0
    assert result["episode_total_response_length/mean"] == 9.0


def test_the_same_rollout_id_in_another_group_is_another_episode():
    samples = [
        make(group_index=0, rollout_id=1, response_length=2),
        make(group_index=1, rollout_id=1, response_length=6),
    ]
    result = compute_episode_response_length_metrics(samples)
    assert (result["episode_response_length/min"], result["episode_response_length/max"]) == (2.0, 6.0)


def test_the_same_rollout_id_under_another_adapter_is_another_episode():
    samples = [
        make(group_index=0, rollout_id=1, response_length=2, adapter=LORA_A),
        make(group_index=0, rollout_id=1, response_length=6, adapter=LORA_B),
    ]
    result = compute_episode_response_length_metrics(samples)
    assert result["adapter/math/episode_response_length/mean"] == 2.0
    assert result["adapter/code/episode_response_length/mean"] == 6.0


def test_with_any_adapter_only_adapter_keys_appear_and_adapterless_samples_feed_none():
    samples = [
        make(group_index=0, rollout_id=1, response_length=2, adapter=LORA_A),
        make(group_index=0, rollout_id=1, response_length=4, adapter=LORA_A),
        make(group_index=0, rollout_id=2, response_length=100),
        make(group_index=0, rollout_id=3, response_length=10, adapter=LORA_B),
    ]
    result = compute_episode_response_length_metrics(samples)
    expected = {f"adapter/math/episode_response_length/{s}": 6.0 for s in LENGTH_SUFFIXES}
    expected |= {f"adapter/code/episode_response_length/{s}": 10.0 for s in LENGTH_SUFFIXES}
    expected |= {"adapter/math/episode_total_response_length/mean": 6.0}
    expected |= {"adapter/code/episode_total_response_length/mean": 10.0}
    assert result == expected


def test_slots_of_one_adapter_name_share_its_metrics_but_stay_separate_episodes():
    samples = [
        make(group_index=0, rollout_id=1, response_length=2, adapter=LORA_A),
        make(group_index=0, rollout_id=1, response_length=6, adapter=LORA_A_OTHER_SLOT),
    ]
    result = compute_episode_response_length_metrics(samples)
    assert result["adapter/math/episode_response_length/min"] == 2.0
    assert result["adapter/math/episode_response_length/max"] == 6.0


def test_samples_without_ids_are_each_their_own_episode():
    samples = [make(group_index=0, response_length=3), make(group_index=0, response_length=5)]
    assert compute_episode_response_length_metrics(samples)["episode_response_length/median"] == 4.0


def test_numpy_loss_masks_count_like_lists():
    samples = [make(rollout_id=1, response_length=4, loss_mask=np.array([1, 0, 1, 1], dtype=np.uint8))]
    assert compute_episode_response_length_metrics(samples)["episode_response_length/mean"] == 3.0


# --- rewards and rows --------------------------------------------------------------------------


def test_compacted_rollouts_count_as_rows_but_vote_once_for_the_reward():
    samples = [make(index=0, rollout_id=10, reward=1.0) for _ in range(3)] + [make(index=1, rollout_id=11, reward=0.0)]
    assert compute_training_sample_metrics(samples) == {"num_training_samples": 4, "episode_raw_reward": 0.5}


def test_sibling_rewards_are_averaged_within_the_rollout_first():
    samples = [make(rollout_id=10, reward=0.0), make(rollout_id=10, reward=1.0), make(rollout_id=11, reward=1.0)]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 0.75


def test_rollout_ids_in_different_groups_are_different_rollouts_for_the_reward():
    samples = [
        make(group_index=0, rollout_id=10, reward=1.0),
        make(group_index=0, rollout_id=10, reward=1.0),
        make(group_index=1, rollout_id=10, reward=0.0),
    ]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 0.5


def test_non_numeric_rewards_are_skipped_and_a_rollout_without_one_is_left_out():
    samples = [
        make(rollout_id=1, reward=None),
        make(rollout_id=1, reward=0.5),
        make(rollout_id=2, reward={"score": 1.0}),
        make(rollout_id=3, reward="good"),
        make(rollout_id=4, reward=float("nan")),
        make(rollout_id=5, reward=0.25),
    ]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 0.375


def test_booleans_and_integers_count_as_numbers():
    samples = [make(rollout_id=1, reward=True), make(rollout_id=2, reward=False), make(rollout_id=3, reward=2)]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 1.0


def test_no_numeric_reward_anywhere_gives_zero():
    samples = [make(rollout_id=1, reward=None), make(rollout_id=2, reward={"a": 1})]
    assert compute_training_sample_metrics(samples) == {"num_training_samples": 2, "episode_raw_reward": 0.0}


def test_metadata_raw_reward_is_used_when_the_first_sample_has_it():
    samples = [
        make(index=5, reward=0.0, metadata={"raw_reward": 1.0}),
        make(index=6, reward=0.0, metadata={"raw_reward": 0.0}),
    ]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 0.5


def test_metadata_raw_reward_is_ignored_when_the_first_sample_lacks_it():
    samples = [make(index=5, reward=0.0), make(index=6, reward=0.0, metadata={"raw_reward": 1.0})]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 0.0


def test_a_sample_lacking_metadata_raw_reward_has_no_reward_when_metadata_is_the_source():
    samples = [make(index=5, reward=0.0, metadata={"raw_reward": 1.0}), make(index=6, reward=0.0)]
    assert compute_training_sample_metrics(samples)["episode_raw_reward"] == 1.0


def test_with_adapters_each_adapter_gets_a_reward_and_the_unscoped_one_covers_all_rollouts():
    samples = [
        make(rollout_id=1, reward=1.0, adapter=LORA_A),
        make(rollout_id=1, reward=0.0, adapter=LORA_B),
        make(rollout_id=2, reward=None, adapter=LORA_B),
        make(rollout_id=1, reward=0.5),
    ]
    assert compute_training_sample_metrics(samples) == {
        "num_training_samples": 4,
        "episode_raw_reward": 0.5,
        "adapter/math/episode_raw_reward": 1.0,
        "adapter/code/episode_raw_reward": 0.0,
    }


# --- the whole batch -------------------------------------------------------------------------


def test_empty_inputs_give_empty_episode_metrics_and_zero_rows():
    assert compute_episode_response_length_metrics([]) == {}
    assert compute_training_sample_metrics([]) == {"num_training_samples": 0, "episode_raw_reward": 0.0}
    assert compute_metrics_from_samples([]) == {"num_training_samples": 0, "episode_raw_reward": 0.0}


def test_the_batch_metrics_are_the_union_of_every_part():
    samples = worked_example()
    samples[1].status = Status.TRUNCATED
    result = compute_metrics_from_samples(samples)
    assert result == (
        compute_training_sample_metrics(samples)
        | compute_episode_response_length_metrics(samples)
        | {"response_len/mean": 3.75, "response_len/median": 3.5, "response_len/max": 6.0, "response_len/min": 2.0}
        | {"truncated_ratio": 0.25}
    )


def test_response_len_counts_effective_lengths_per_row_even_for_removed_rows():
    samples = [make(rollout_id=1, response_length=4, remove_sample=True), make(rollout_id=2, response_length=2)]
    assert compute_metrics_from_samples(samples)["response_len/max"] == 4.0


def test_weight_versions_use_each_samples_oldest_numeric_version_and_skip_the_rest():
    samples = [
        make(rollout_id=1, weight_versions=["7", "5"]),
        make(rollout_id=2, weight_versions=["9", "latest"]),
        make(rollout_id=3, weight_versions=["latest"]),
        make(rollout_id=4),
    ]
    result = compute_metrics_from_samples(samples)
    assert {k: v for k, v in result.items() if k.startswith("weight_version/")} == {
        "weight_version/mean": 7.0,
        "weight_version/median": 7.0,
        "weight_version/max": 9.0,
        "weight_version/min": 5.0,
    }


def test_weight_version_keys_are_omitted_without_numeric_versions():
    result = compute_metrics_from_samples([make(rollout_id=1, weight_versions=["v1"])])
    assert not any(key.startswith("weight_version/") for key in result)


def test_truncated_ratio_is_the_share_of_truncated_rows():
    statuses = [Status.TRUNCATED, Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.COMPLETED]
    samples = [make(rollout_id=i, status=s) for i, s in enumerate(statuses)]
    assert compute_metrics_from_samples(samples)["truncated_ratio"] == 0.4


# --- against a naive reference -----------------------------------------------------------------

ADAPTERS = (None, LORA_A, LORA_B, LORA_A_OTHER_SLOT)
REWARDS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(-10, 10, allow_nan=False),
    st.just(float("nan")),
    st.just({"score": 1.0}),
    st.text(max_size=2),
)


@st.composite
def segment_strategy(draw, identity: dict) -> Sample:
    length = draw(st.integers(0, 6))
    mask = draw(st.none() | st.lists(st.integers(0, 1), min_size=length, max_size=length))
    metadata = draw(st.just({}) | st.fixed_dictionaries({"raw_reward": REWARDS}))
    return Sample(
        **identity,
        response_length=length,
        loss_mask=mask,
        remove_sample=draw(st.booleans()),
        reward=draw(REWARDS),
        metadata=metadata,
        status=draw(st.sampled_from(list(Status))),
        weight_versions=draw(st.lists(st.sampled_from(["1", "4", "12", "latest"]), max_size=3)),
    )


@st.composite
def episodes_strategy(draw, max_episodes: int = 8) -> list[list[Sample]]:
    """Finished episodes with distinct rollout keys: siblings, adapters, id-less samples."""
    adapters = ADAPTERS if draw(st.booleans()) else (None,)
    episodes, seen = [], set()
    for _ in range(draw(st.integers(0, max_episodes))):
        kind = draw(st.sampled_from(["rollout", "sample", "position"]))
        identity = {"adapter": draw(st.sampled_from(adapters)), "group_index": draw(st.integers(0, 2))}
        if kind != "position":
            identity["rollout_id" if kind == "rollout" else "index"] = draw(st.integers(0, 3))
            number = identity.get("rollout_id", identity.get("index"))
            key = (identity["adapter"], kind, identity["group_index"], number)
            if key in seen:
                continue
            seen.add(key)
        count = 1 if kind == "position" else draw(st.integers(1, 3))
        episodes.append([draw(segment_strategy(identity)) for _ in range(count)])
    return episodes


def _naive_key(sample: Sample, position: int) -> tuple:
    ident = ("rollout", sample.rollout_id) if sample.rollout_id is not None else None
    ident = ident or (("sample", sample.index) if sample.index is not None else ("position", position))
    return (sample.adapter, sample.group_index) + ident


def _naive_reward(sample: Sample, from_metadata: bool):
    value = sample.metadata.get("raw_reward") if from_metadata else sample.reward
    if isinstance(value, (bool, int, float)) and math.isfinite(value):
        return float(value)
    return None


def naive_metrics(samples: list[Sample]) -> dict[str, float]:
    """Section 6 written out the plain way: lists, the statistics module, float means."""
    rollouts: dict[tuple, list[Sample]] = {}
    for position, sample in enumerate(samples):
        rollouts.setdefault(_naive_key(sample, position), []).append(sample)
    result: dict[str, float] = {"num_training_samples": len(samples)}
    from_metadata = bool(samples) and "raw_reward" in samples[0].metadata
    names = sorted({s.adapter.name for s in samples if s.adapter is not None})
    for name in [None] + names:
        prefix = "" if name is None else f"adapter/{name}/"
        means = []
        for key, group in rollouts.items():
            if name is None or (key[0] is not None and key[0].name == name):
                rewards = [r for r in (_naive_reward(s, from_metadata) for s in group) if r is not None]
                if rewards:
                    means.append(sum(rewards) / len(rewards))
        result[f"{prefix}episode_raw_reward"] = sum(means) / len(means) if means else 0.0
        if samples and (name is None) == (not names):
            picked = [g for k, g in rollouts.items() if (k[0].name if k[0] else None) == name]
            trainable = [sum(0 if s.remove_sample else s.effective_response_length for s in g) for g in picked]
            total = [sum(s.response_length for s in g) for g in picked]
            for stat in ("mean", "median", "max", "min"):
                function = {"mean": statistics.mean, "median": statistics.median, "max": max, "min": min}[stat]
                result[f"{prefix}episode_response_length/{stat}"] = float(function(trainable))
            result[f"{prefix}episode_total_response_length/mean"] = float(statistics.mean(total))
    if samples:
        result |= _naive_statistics([s.effective_response_length for s in samples], "response_len/")
        result["truncated_ratio"] = sum(s.status == "truncated" for s in samples) / len(samples)
        digits = [[int(v) for v in s.weight_versions if v.isdigit()] for s in samples]
        versions = [min(numbers) for numbers in digits if numbers]
        if versions:
            result |= _naive_statistics(versions, "weight_version/")
    return result


def _naive_statistics(values: list[int], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}mean": float(statistics.mean(values)),
        f"{prefix}median": float(statistics.median(values)),
        f"{prefix}max": float(max(values)),
        f"{prefix}min": float(min(values)),
    }


@settings(max_examples=200, deadline=None)
@given(episodes_strategy(), st.randoms(use_true_random=False))
def test_batch_metrics_match_a_naive_reimplementation_in_any_row_order(episodes, rng):
    samples = [segment for episode in episodes for segment in episode]
    rng.shuffle(samples)
    result, expected = compute_metrics_from_samples(samples), naive_metrics(samples)
    assert result.keys() == expected.keys()
    for key, value in expected.items():
        if key.endswith("episode_raw_reward"):
            assert result[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        else:
            assert result[key] == value, key
