"""Turns: forced sampling tokens, mask merging, pair merging and episode folding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.turns import (
    append_forced_sampling_tokens,
    merge_sample_pair,
    merge_samples,
    merge_sampling_masks,
)

FAST = settings(max_examples=60, deadline=None)


def rows_of(mask: RolloutSamplingMask) -> list[list[int]]:
    return [mask.row(t).tolist() for t in range(len(mask))]


def two_turns(**b_overrides) -> tuple[Sample, Sample]:
    """Prompt [1, 2]; turn a samples 3 (support [3, 4]); observation [20, 21]; turn b samples 30 (support [30, 7, 8])."""
    a = Sample(group_index=0, index=5, rollout_id=50, tokens=[1, 2, 3], response="x", response_length=1,
               loss_mask=[1], rollout_log_probs=[-0.5], weight_versions=["1"], status=Status.COMPLETED,
               rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[3, 4]]), reward=0.0, metadata={"a": 1})
    values = dict(group_index=0, index=5, rollout_id=50, tokens=[1, 2, 3, 20, 21, 30], response="y",
                  response_length=1, loss_mask=None, rollout_log_probs=[-0.25], weight_versions=["2"],
                  status=Status.TRUNCATED, rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[30, 7, 8]]),
                  reward=1.0, metadata={"b": 2})
    values.update(b_overrides)
    return a, Sample(**values)


# --- append_forced_sampling_tokens --------------------------------------------------------------


def test_worked_example_forced_tokens_extend_a_one_token_mask():
    sample = Sample(tokens=[1, 2, 3], response_length=1, rollout_sampling_mask=RolloutSamplingMask([10, 4], [0, 2]))
    before = sample.rollout_sampling_mask
    append_forced_sampling_tokens(sample, [20, 21])
    ids, offsets = sample.rollout_sampling_mask.as_arrays()
    assert ids.tolist() == [10, 4, 20, 21] and offsets.tolist() == [0, 2, 3, 4]
    assert rows_of(before) == [[10, 4]]  # the old mask object is untouched, only the attribute is replaced
    assert sample.response_length == 1 and sample.tokens == [1, 2, 3]  # caller extends the response


def test_forced_tokens_start_a_mask_on_a_sample_without_response():
    sample = Sample(tokens=[1, 2])
    append_forced_sampling_tokens(sample, np.array([7, 8]))
    assert rows_of(sample.rollout_sampling_mask) == [[7], [8]]


def test_forced_tokens_cannot_start_a_mask_after_response_tokens_exist():
    sample = Sample(tokens=[1, 2], response_length=1)
    with pytest.raises(ContractError, match="response_length"):
        append_forced_sampling_tokens(sample, [7])
    assert sample.rollout_sampling_mask is None


def test_forced_tokens_need_a_mask_aligned_with_the_response():
    sample = Sample(tokens=[1, 2, 3], response_length=2, rollout_sampling_mask=RolloutSamplingMask([3], [0, 1]))
    with pytest.raises(ContractError) as info:
        append_forced_sampling_tokens(sample, [7])
    assert "response_length=2" in str(info.value) and "(got 1)" in str(info.value)


# --- merge_sampling_masks ----------------------------------------------------------------------


def test_merge_sampling_masks_puts_singleton_observation_rows_between_the_turns():
    a, b = two_turns()
    merged = merge_sampling_masks(a, [20, 21], b)
    assert rows_of(merged) == [[3, 4], [20], [21], [30, 7, 8]]
    assert merge_sampling_masks(a.rollout_sampling_mask, [20, 21], b.rollout_sampling_mask) == merged


def test_merge_sampling_masks_of_two_maskless_turns_is_none():
    a, b = two_turns(rollout_sampling_mask=None)
    a.rollout_sampling_mask = None
    assert merge_sampling_masks(a, [20, 21], b) is None


@pytest.mark.parametrize("missing", ["first", "second"])
def test_merge_sampling_masks_refuses_to_merge_when_one_turn_lacks_its_mask(missing):
    a, b = two_turns()
    (a if missing == "first" else b).rollout_sampling_mask = None
    with pytest.raises(ContractError, match=f"{missing} rollout_sampling_mask"):
        merge_sampling_masks(a, [20, 21], b)


# --- merge_sample_pair -------------------------------------------------------------------------


def test_worked_example_merging_two_turns_around_an_observation():
    a, b = two_turns()
    merged = merge_sample_pair(a, b)
    ids, offsets = merged.rollout_sampling_mask.as_arrays()
    assert ids.tolist() == [3, 4, 20, 21, 30, 7, 8] and offsets.tolist() == [0, 2, 3, 4, 7]


def test_the_contract_worked_example_with_its_exact_mask_ids():
    a = Sample(tokens=[1, 10], response_length=1, status=Status.COMPLETED,
               rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[10, 4]]))
    b = Sample(tokens=[1, 10, 20, 21, 30], response_length=1, status=Status.COMPLETED,
               rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[30, 7, 8]]))
    ids, offsets = merge_sample_pair(a, b).rollout_sampling_mask.as_arrays()
    assert ids.tolist() == [10, 4, 20, 21, 30, 7, 8] and offsets.tolist() == [0, 2, 3, 4, 7]


def test_merge_sample_pair_joins_every_per_token_field_with_the_observation_between():
    a, b = two_turns()
    merged = merge_sample_pair(a, b)
    assert merged.tokens.tolist() == [1, 2, 3, 20, 21, 30] and merged.response_length == 4
    assert merged.loss_mask.tolist() == [1, 0, 0, 1]
    assert merged.rollout_log_probs.tolist() == [-0.5, 0.0, 0.0, -0.25]
    assert merged.weight_versions == ["1", "2"] and merged.status is Status.TRUNCATED
    assert merged.reward == 1.0 and merged.metadata == {"a": 1, "b": 2} and merged.response == "xy"
    assert (merged.group_index, merged.index, merged.rollout_id) == (0, 5, 50)
    merged.validate()


def test_merge_sample_pair_keeps_log_probs_none_when_neither_turn_has_them():
    a, b = two_turns(rollout_log_probs=None)
    a.rollout_log_probs = None
    assert merge_sample_pair(a, b).rollout_log_probs is None


def test_merge_sample_pair_fills_zero_log_probs_for_a_turn_without_them():
    a, b = two_turns(rollout_log_probs=None)
    assert merge_sample_pair(a, b).rollout_log_probs.tolist() == [-0.5, 0.0, 0.0, 0.0]


def test_merge_sample_pair_does_not_mutate_or_alias_its_inputs():
    a, b = two_turns(tokens=np.array([1, 2, 3, 20, 21, 30]))
    a_before, b_before = copy.deepcopy(a), copy.deepcopy(b)
    merged = merge_sample_pair(a, b)
    assert a == a_before and b == b_before
    assert not np.shares_memory(merged.tokens, b.tokens)
    merged.metadata["c"] = 3
    merged.weight_versions.append("9")
    assert a.metadata == {"a": 1} and b.metadata == {"b": 2} and a.weight_versions == ["1"]


def test_merge_sample_pair_decodes_the_observation_with_a_tokenizer():
    class Tokenizer:
        def decode(self, ids):
            return "<" + " ".join(map(str, ids)) + ">"

    a, b = two_turns()
    assert merge_sample_pair(a, b, tokenizer=Tokenizer()).response == "x<20 21>y"


@pytest.mark.parametrize(
    ("field", "value"),
    [("group_index", 1), ("index", 6), ("rollout_id", 51), ("adapter", AdapterRef("m", 0)),
     ("label", "other"), ("remove_sample", True)],
)
def test_merge_sample_pair_requires_equal_identity_fields(field, value):
    a, b = two_turns(**{field: value})
    with pytest.raises(ContractError, match=f"'{field}'"):
        merge_sample_pair(a, b)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"tokens": [1, 2, 9, 20, 21, 30]}, "continuation"),
        ({"tokens": [1, 2]}, "continuation"),
        ({"tokens": [1, 2, 3, 30]}, "'obs_len' must be > 0"),
        ({"tokens": [1, 2, 3, 20, 30], "response_length": 2,
          "rollout_log_probs": [0.0, -0.1],
          "rollout_sampling_mask": RolloutSamplingMask.from_mask_list([[20], [30]])}, "'obs_len' must be > 0"),
        ({"rollout_sampling_mask": None}, "second rollout_sampling_mask"),
        ({"loss_mask": [1, 1]}, "len(loss_mask)"),
    ],
)
def test_merge_sample_pair_rejects_turns_that_do_not_continue_cleanly(overrides, pattern):
    a, b = two_turns(**overrides)
    with pytest.raises(ContractError) as info:
        merge_sample_pair(a, b)
    assert pattern in str(info.value)


# --- merge_samples -----------------------------------------------------------------------------


def test_merge_samples_of_nothing_is_nothing_and_of_one_turn_is_a_copy():
    assert merge_samples([]) == []
    a, _ = two_turns()
    [single] = merge_samples([a])
    assert single == a and single is not a


def test_merge_samples_folds_a_completed_episode_into_one_sample():
    a, b = two_turns()
    assert merge_samples([a, b]) == [merge_sample_pair(a, b)]


def test_merge_samples_starts_a_new_segment_after_a_turn_that_did_not_complete():
    a, b = two_turns()
    a.status = Status.TRUNCATED
    assert merge_samples([a, b]) == [a, b]


def test_merge_samples_starts_a_new_segment_after_compaction():
    a, b = two_turns(tokens=[1, 99, 30])
    segments = merge_samples([a, b])
    assert [list(s.tokens) for s in segments] == [[1, 2, 3], [1, 99, 30]]


def test_merge_samples_starts_a_new_segment_at_a_replay_gap():
    a, b = two_turns(rollout_sampling_mask=None)
    segments = merge_samples([a, b])
    assert len(segments) == 2 and segments[1].rollout_sampling_mask is None


def test_merge_samples_raises_when_a_mask_appears_mid_segment():
    a, b = two_turns()
    a.rollout_sampling_mask = None
    with pytest.raises(ContractError, match="first rollout_sampling_mask"):
        merge_samples([a, b])


# --- properties against a list model ------------------------------------------------------------

ids = st.integers(0, 200)
turn_strategy = st.fixed_dictionaries({
    "obs": st.lists(ids, min_size=1, max_size=4),
    "rows": st.lists(st.lists(ids, min_size=1, max_size=4), max_size=5),
    "loss": st.booleans(),
    "logprobs": st.booleans(),
    "status": st.sampled_from([Status.COMPLETED] * 4 + [Status.TRUNCATED, Status.ABORTED]),
    "compacted": st.sampled_from([False] * 4 + [True]),
    "mask": st.sampled_from([True] * 5 + [False]),
})


def build_turns(prompt: list[int], turns: list[dict]) -> list[Sample]:
    """Each turn's tokens are the whole history so far plus its response, as engines produce them."""
    history, samples = list(prompt), []
    for i, turn in enumerate(turns):
        if i and turn["compacted"]:
            history = [1000 + i]  # the summary replaces the history
        elif i:
            history += turn["obs"]
        rows = turn["rows"]
        history += [row[0] for row in rows]
        n = len(rows)
        samples.append(Sample(
            index=3, tokens=np.array(history) if i % 2 else list(history), response_length=n,
            loss_mask=[(i + t) % 2 for t in range(n)] if turn["loss"] else None,
            rollout_log_probs=[-(i + t) / 10 for t in range(n)] if turn["logprobs"] else None,
            rollout_sampling_mask=RolloutSamplingMask.from_mask_list(rows) if turn["mask"] else None,
            weight_versions=[str(i)], status=turn["status"], reward=float(i),
        ))
    return samples


def model_merge(turns: list[dict], start: int, stop: int) -> dict:
    """Expected merge of turns[start:stop] as plain lists."""
    loss, logprobs, rows = [], [], []
    any_logprobs = any(t["logprobs"] for t in turns[start:stop])
    for i in range(start, stop):
        turn, n = turns[i], len(turns[i]["rows"])
        if i > start:
            loss += [0] * len(turn["obs"])
            logprobs += [0.0] * len(turn["obs"])
            rows += [[o] for o in turn["obs"]]
        loss += [(i + t) % 2 for t in range(n)] if turn["loss"] else [1] * n
        logprobs += [-(i + t) / 10 for t in range(n)] if turn["logprobs"] else [0.0] * n
        rows += turn["rows"]
    return {"loss": loss, "logprobs": logprobs if any_logprobs else None, "rows": rows,
            "mask": turns[start]["mask"], "versions": [str(i) for i in range(start, stop)]}


def model_segments(turns: list[dict]) -> list[tuple[int, int]] | None:
    """Segment boundaries by the contract's rule; None when the merge must raise."""
    bounds, start = [], 0
    for i in range(1, len(turns)):
        prev, cur = turns[i - 1], turns[i]
        if prev["status"] != Status.COMPLETED or cur["compacted"] or (prev["mask"] and not cur["mask"]):
            bounds.append((start, i))
            start = i
        elif cur["mask"] and not prev["mask"]:
            return None
    return bounds + [(start, len(turns))] if turns else []


@FAST
@given(st.lists(ids, min_size=1, max_size=3), st.lists(turn_strategy, max_size=6))
def test_merge_samples_matches_the_list_model(prompt, turns):
    samples = build_turns(prompt, turns)
    before = copy.deepcopy(samples)
    expected = model_segments(turns)
    if expected is None:
        with pytest.raises(ContractError):
            merge_samples(samples)
        return
    segments = merge_samples(samples)
    assert samples == before
    assert len(segments) == len(expected)
    for segment, (start, stop) in zip(segments, expected):
        model = model_merge(turns, start, stop)
        segment.validate()
        assert list(segment.tokens) == list(samples[stop - 1].tokens)
        assert segment.response_length == len(model["rows"])
        assert segment.status == samples[stop - 1].status and segment.weight_versions == model["versions"]
        if stop - start > 1:
            assert list(segment.loss_mask) == model["loss"]
            got = None if segment.rollout_log_probs is None else list(segment.rollout_log_probs)
            assert got == model["logprobs"]
        if model["mask"]:
            assert rows_of(segment.rollout_sampling_mask) == model["rows"]
        else:
            assert segment.rollout_sampling_mask is None


@FAST
@given(st.lists(ids, min_size=1, max_size=3), st.lists(turn_strategy, min_size=1, max_size=5))
def test_merge_samples_equals_folding_merge_sample_pair(prompt, turns):
    for turn in turns:
        turn.update(status=Status.COMPLETED, compacted=False, mask=True)
    samples = build_turns(prompt, turns)
    folded = samples[0]
    for sample in samples[1:]:
        folded = merge_sample_pair(folded, sample)
    [merged] = merge_samples(samples)
    assert merged == folded
