"""Per-response-token weight versions: validated, merged with -1 for observations, carried to the
trainer's shards all-or-nothing; an aborted turn and its continuation merge into one response."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_bus.model.turns import split_turn
from rollout_bus.errors import ContractError
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.train_data import convert_samples_to_train_data
from rollout_bus.model.turns import append_forced_sampling_tokens, merge_samples


def turn(tokens, response_length, versions, *, status=Status.COMPLETED, reward=None):
    rows = [[t, (t + 1) % 50] for t in tokens[len(tokens) - response_length:]]
    return Sample(group_index=0, index=1, rollout_id=1, tokens=np.array(tokens), response_length=response_length,
                  loss_mask=np.ones(response_length, np.int64),
                  rollout_log_probs=-np.arange(1, response_length + 1, dtype=np.float64) / 10,
                  rollout_sampling_mask=RolloutSamplingMask.from_mask_list(rows), status=status, reward=reward,
                  weight_versions=[str(v) for v in sorted(set(versions))], rollout_token_versions=np.array(versions))


def test_versions_are_checked_against_the_response():
    with pytest.raises(ContractError, match="len.rollout_token_versions."):
        turn([1, 2, 3], 2, [0]).validate()
    with pytest.raises(ContractError, match="-1 for a token not generated"):
        turn([1, 2, 3], 2, [0, -2]).validate()


def test_merging_turns_concatenates_versions_with_minus_one_for_the_observation():
    first = turn([1, 2, 3, 4], 2, [0, 0])
    second = turn([1, 2, 3, 4, 9, 9, 5, 6], 2, [1, 1], reward=1.0)  # observation 9, 9 between the turns
    (merged,) = merge_samples([first, second])
    assert merged.rollout_token_versions.tolist() == [0, 0, -1, -1, 1, 1]
    unknown = turn([1, 2, 3, 4, 9, 9, 5, 6], 2, [1, 1])
    unknown.rollout_token_versions = None
    assert merge_samples([first, unknown])[0].rollout_token_versions is None  # one turn without: unknown


def test_an_aborted_turn_and_its_continuation_merge_into_the_uninterrupted_turn():
    whole = turn([1, 2, 3, 4, 5, 6, 7], 5, [3, 3, 3, 3, 3], reward=0.5)
    aborted, continuation = split_turn(whole, 2, old_version=2, new_version=3)
    assert aborted.status is Status.ABORTED and aborted.reward is None and aborted.response_length == 2
    assert continuation.response_length == 3 and continuation.tokens.tolist() == whole.tokens.tolist()
    (merged,) = merge_samples([aborted, continuation])
    for name in ("tokens", "loss_mask", "rollout_log_probs"):
        assert np.array_equal(getattr(merged, name), getattr(whole, name)), name
    assert merged.rollout_sampling_mask == whole.rollout_sampling_mask
    assert (merged.status, merged.reward, merged.response_length) == (Status.COMPLETED, 0.5, 5)
    assert merged.rollout_token_versions.tolist() == [2, 2, 3, 3, 3]
    # an aborted turn followed by a turn that is not its continuation starts a sibling, as before
    other = turn([1, 2, 3, 8, 8, 8], 2, [3, 3])
    assert len(merge_samples([aborted, other])) == 2


def test_forced_tokens_get_minus_one_and_the_trainer_data_carries_versions_only_when_every_sample_has_them():
    sample = turn([1, 2, 3], 2, [4, 4])
    append_forced_sampling_tokens(sample, [7, 8])
    sample.tokens = np.concatenate([sample.tokens, [7, 8]])
    sample.response_length += 2
    sample.loss_mask = np.concatenate([sample.loss_mask, [0, 0]])
    sample.rollout_log_probs = np.concatenate([sample.rollout_log_probs, [0.0, 0.0]])
    sample.validate()
    assert sample.rollout_token_versions.tolist() == [4, 4, -1, -1]
    data = convert_samples_to_train_data([sample, turn([5, 6], 1, [3])])
    assert [v.tolist() for v in data["rollout_token_versions"]] == [[4, 4, -1, -1], [3]]
    without = turn([5, 6], 1, [3])
    without.rollout_token_versions = None
    assert "rollout_token_versions" not in convert_samples_to_train_data([sample, without])


def test_shards_carry_each_response_tokens_version(tmp_path):
    from rollout_bus.model.shards import load_shard, write_batch_shards
    from rollout_bus.model.train_data import split_train_data_by_dp

    samples = [turn([1, 2, 3, 4], 3, [5, -1, 6]), turn([7, 8], 1, [6])]
    manifest = write_batch_shards(tmp_path, 0, split_train_data_by_dp(convert_samples_to_train_data(samples), 1),
                                  metrics={}, sources=[])
    assert manifest["has_rollout_token_versions"]
    read = list(load_shard(tmp_path / "batch-00000000" / "dp-000.safetensors").samples())
    assert [s.rollout_token_versions.tolist() for s in read] == [[5, -1, 6], [6]]


def test_a_sample_without_versions_encodes_as_before_and_an_older_payload_decodes():
    import json

    import safetensors.numpy

    from rollout_bus.wire.codec import COMPUTED_FIELDS, decode_samples, encode_samples

    without = turn([1, 2, 3], 2, [4, 4])
    without.rollout_token_versions = None
    without.rollout_sampling_mask = None  # the default fields carry no mask
    payload = encode_samples([without])
    tensors = safetensors.numpy.load(payload)
    assert not any(name.startswith("rollout_token_versions") for name in tensors)
    assert json.loads(tensors["_samples_meta"].tobytes())["samples"][0]["nulls"] == []  # nothing new on the wire
    (back,), _ = decode_samples(payload, COMPUTED_FIELDS)
    assert back.rollout_token_versions is None and back == without
    (with_versions,), _ = decode_samples(encode_samples([turn([1, 2, 3], 2, [4, 4])]))
    assert with_versions.rollout_token_versions.tolist() == [4, 4]


def test_versions_that_are_not_integers_are_refused_by_name_and_a_refused_forced_append_changes_nothing():
    for bad in ([1.5, 2.0], ["3", "4"], [2**70, 1]):
        sample = turn([1, 2, 3], 2, [0, 0])
        sample.rollout_token_versions = np.array(bad, dtype=object) if isinstance(bad[0], int) else np.array(bad)
        with pytest.raises(ContractError, match="rollout_token_versions"):
            sample.validate()
    sample = turn([1, 2, 3], 2, [0, 0])
    sample.rollout_sampling_mask = None  # a mask cannot start after response tokens: the append is refused
    with pytest.raises(ContractError, match="response_length"):
        append_forced_sampling_tokens(sample, [7])
    assert sample.rollout_token_versions.tolist() == [0, 0]
