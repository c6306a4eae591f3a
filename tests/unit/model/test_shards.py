"""Batch shards on disk: layout, manifest, atomic writes, loading (docs/data-model.md section 5)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import safetensors.torch
import torch

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.shard_tensors import shard_tensors
from rollout_bus.model.train_data import convert_samples_to_train_data, split_train_data_by_dp
from rollout_bus.model.shards import MANIFEST_NAME, batch_path, load_shard, read_manifest, verify_batch, write_batch_shards

SOURCES = [{"topic": "rollout.episodes", "partition": 0, "first_offset": 10, "last_offset": 15}]
METRICS = {"rollout/response_len/mean": np.float64(3.5), "rollout/truncated_ratio": 0.0, "bad": float("nan")}


def make_samples(n: int = 7, *, masks: bool = True, log_probs: bool = True) -> list[Sample]:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        response_length = int(rng.integers(0, 6))
        prompt_length = int(rng.integers(1, 5))
        tokens = rng.integers(0, 50_000, prompt_length + response_length)
        rows = [rng.choice(50_000, int(rng.integers(1, 4)), replace=False) for _ in range(response_length)]
        samples.append(Sample(
            group_index=i // 3,
            index=i,
            rollout_id=100 + i,
            tokens=tokens,
            response_length=response_length,
            reward=float(i % 3),
            loss_mask=rng.integers(0, 2, response_length),
            rollout_log_probs=rng.normal(size=response_length) if log_probs else None,
            rollout_sampling_mask=RolloutSamplingMask.from_mask_list(rows) if masks else None,
            remove_sample=(i == 4),
            status=Status.TRUNCATED if i == 2 else Status.COMPLETED,
            adapter=AdapterRef("lora-a", 3) if i % 2 else None,
        ))
    return samples


def write(tmp_path, samples=None, dp_size: int = 3, seq: int = 5, **kwargs):
    data = convert_samples_to_train_data(make_samples() if samples is None else samples)
    ranks = split_train_data_by_dp(data, dp_size)
    manifest = write_batch_shards(tmp_path, seq, ranks, metrics=METRICS, sources=SOURCES, **kwargs)
    return data, ranks, manifest


def test_every_field_survives_the_round_trip_through_a_shard(tmp_path):
    data, ranks, manifest = write(tmp_path)
    seen = []
    for entry, rank in zip(manifest["shards"], ranks, strict=True):
        view = load_shard(batch_path(tmp_path, 5) / entry["path"])
        assert len(view) == len(rank["partition"]) == entry["num_samples"]
        for record in view:
            p = record.position
            seen.append(p)
            np.testing.assert_array_equal(record.tokens.numpy(), data["tokens"][p])
            assert record.response_length == data["response_lengths"][p]
            np.testing.assert_array_equal(record.loss_mask.numpy(), data["loss_masks"][p])
            np.testing.assert_array_equal(record.rollout_log_probs.numpy(), data["rollout_log_probs"][p])
            assert record.reward == pytest.approx(data["rewards"][p], abs=1e-6)
            assert record.raw_reward == np.float32(data["raw_reward"][p])
            assert record.truncated == bool(data["truncated"][p])
            assert (record.rollout_id, record.sample_index, record.group_index, record.adapter_slot) == (
                data["rollout_ids"][p], data["sample_indices"][p], data["group_indices"][p], data["adapter_slots"][p]
            )
            expected_mask = RolloutSamplingMask(data["rollout_sampling_mask_ids"][p],
                                                data["rollout_sampling_mask_offsets"][p])
            assert record.rollout_sampling_mask == expected_mask
    assert sorted(seen) == list(range(7))


def test_a_shard_loads_with_plain_safetensors_in_the_contract_dtypes_without_padding(tmp_path):
    data, ranks, manifest = write(tmp_path, dp_size=1)
    tensors = safetensors.torch.load_file(str(batch_path(tmp_path, 5) / "dp-000.safetensors"))
    dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    assert dtypes == {
        "tokens": "int32", "tokens_offsets": "int64", "response_lengths": "int64", "loss_masks": "uint8",
        "rollout_log_probs": "float32", "rollout_sampling_mask_ids": "int32",
        "rollout_sampling_mask_offsets": "int64", "rewards": "float32", "raw_rewards": "float32",
        "truncated": "uint8", "rollout_ids": "int64", "sample_indices": "int64", "group_indices": "int64",
        "adapter_slots": "int64", "partition": "int64",
    }
    total_tokens = sum(len(t) for t in data["tokens"])
    total_response = sum(data["response_lengths"])
    total_ids = sum(len(i) for i in data["rollout_sampling_mask_ids"])
    assert tensors["tokens"].numel() == total_tokens and tensors["tokens_offsets"].numel() == 8
    assert tensors["loss_masks"].numel() == total_response
    assert tensors["rollout_sampling_mask_offsets"].numel() == total_response + 1
    assert tensors["rollout_sampling_mask_ids"].numel() == total_ids
    assert tensors["partition"].tolist() == list(range(7))
    assert manifest["shards"][0]["num_tokens"] == total_tokens
    assert manifest["shards"][0]["num_response_tokens"] == total_response


def test_the_manifest_names_every_shard_with_its_sha256_counts_sources_and_metrics(tmp_path):
    _, ranks, manifest = write(tmp_path)
    directory = batch_path(tmp_path, 5)
    assert directory.name == "batch-00000005"
    assert read_manifest(directory) == manifest
    assert [e["path"] for e in manifest["shards"]] == ["dp-000.safetensors", "dp-001.safetensors", "dp-002.safetensors"]
    for entry, rank in zip(manifest["shards"], ranks, strict=True):
        body = (directory / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(body).hexdigest()
        assert entry["num_samples"] == len(rank["partition"])
    assert manifest["seq"] == 5 and manifest["num_samples"] == 7
    assert manifest["sources"] == SOURCES
    assert manifest["metrics"] == {"rollout/response_len/mean": 3.5, "rollout/truncated_ratio": 0.0, "bad": None}
    assert verify_batch(directory) == manifest


def test_writing_the_same_batch_twice_gives_byte_identical_files(tmp_path):
    write(tmp_path)
    directory = batch_path(tmp_path, 5)
    first = {p.name: p.read_bytes() for p in directory.iterdir()}
    write(tmp_path)
    second = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert first == second
    assert json.loads(first[MANIFEST_NAME])["seq"] == 5


def test_a_failed_rename_leaves_no_final_named_file_and_no_manifest(tmp_path, monkeypatch):
    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write(tmp_path)
    directory = batch_path(tmp_path, 5)
    assert list(directory.iterdir()) == []
    assert read_manifest(directory) is None


def test_a_failed_shard_write_midway_leaves_the_batch_without_a_manifest(tmp_path, monkeypatch):
    write(tmp_path)
    real_replace, calls = os.replace, []

    def replace_twice(src, dst):
        calls.append(dst)
        if len(calls) > 1:
            raise OSError("crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_twice)
    with pytest.raises(OSError):
        write(tmp_path)
    assert verify_batch(batch_path(tmp_path, 5)) is None
    assert not [p for p in batch_path(tmp_path, 5).iterdir() if p.name.endswith(".tmp")]


def test_leftover_temporary_files_are_removed_by_the_next_write(tmp_path):
    directory = batch_path(tmp_path, 5)
    directory.mkdir(parents=True)
    (directory / ".dp-000.safetensors.123-abcd.tmp").write_bytes(b"partial")
    write(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == [
        "dp-000.safetensors", "dp-001.safetensors", "dp-002.safetensors", MANIFEST_NAME
    ]


def test_rewriting_with_fewer_ranks_removes_stale_shards(tmp_path):
    write(tmp_path, dp_size=3)
    manifest = write(tmp_path, dp_size=2)[2]
    names = sorted(p.name for p in batch_path(tmp_path, 5).iterdir())
    assert names == ["dp-000.safetensors", "dp-001.safetensors", MANIFEST_NAME]
    assert manifest["dp_size"] == 2


def test_verify_batch_detects_a_corrupted_shard(tmp_path):
    write(tmp_path)
    shard = batch_path(tmp_path, 5) / "dp-001.safetensors"
    body = bytearray(shard.read_bytes())
    body[-1] ^= 0xFF
    shard.write_bytes(bytes(body))
    with pytest.raises(ContractError, match="dp-001.safetensors"):
        verify_batch(batch_path(tmp_path, 5))


def test_a_missing_manifest_means_an_incomplete_batch(tmp_path):
    assert read_manifest(tmp_path / "batch-00000009") is None
    assert verify_batch(tmp_path / "batch-00000009") is None


def test_an_unparseable_manifest_is_a_contract_error(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ContractError, match="manifest"):
        read_manifest(tmp_path)


def test_batches_without_masks_or_log_probs_store_neither(tmp_path):
    samples = make_samples(masks=False, log_probs=False)
    _, _, manifest = write(tmp_path, samples=samples, dp_size=2)
    view = load_shard(batch_path(tmp_path, 5) / "dp-000.safetensors")
    assert "rollout_sampling_mask_ids" not in view.tensors and "rollout_log_probs" not in view.tensors
    assert all(r.rollout_sampling_mask is None and r.rollout_log_probs is None for r in view.samples())
    assert manifest["has_sampling_masks"] is False


def test_an_empty_rank_writes_a_valid_empty_shard(tmp_path):
    _, _, manifest = write(tmp_path, samples=make_samples(2), dp_size=4)
    empty = [e for e in manifest["shards"] if e["num_samples"] == 0]
    assert len(empty) == 2
    view = load_shard(batch_path(tmp_path, 5) / empty[0]["path"])
    assert len(view) == 0 and list(view) == []
    assert view.tensors["rollout_sampling_mask_offsets"].tolist() == [0]


def test_extra_is_stored_and_non_json_metrics_are_rejected(tmp_path):
    _, _, manifest = write(tmp_path, extra={"mode": "step", "groups": (1, 2)})
    assert manifest["extra"] == {"mode": "step", "groups": [1, 2]}
    ranks = split_train_data_by_dp(convert_samples_to_train_data(make_samples(2)), 1)
    with pytest.raises(ContractError, match="metrics.when"):
        write_batch_shards(tmp_path, 6, ranks, metrics={"when": object()}, sources=[])


def test_rank_data_without_a_partition_is_rejected(tmp_path):
    data = convert_samples_to_train_data(make_samples(2))
    with pytest.raises(ContractError, match="partition"):
        write_batch_shards(tmp_path, 1, [data], metrics={}, sources=[])


def save_tensors(tmp_path, tensors):
    path = tmp_path / "broken.safetensors"
    safetensors.torch.save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, str(path))
    return path


def valid_tensors():
    ranks = split_train_data_by_dp(convert_samples_to_train_data(make_samples(4)), 1)
    return shard_tensors(ranks[0])


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        pytest.param(lambda t: t.update(tokens_offsets=t["tokens_offsets"][:-1]), "tokens_offsets",
                     id="short-token-offsets"),
        pytest.param(lambda t: t.update(loss_masks=t["loss_masks"][:-1]), "loss_masks", id="short-loss-masks"),
        pytest.param(lambda t: t.update(rewards=t["rewards"][:-1]), "rewards", id="short-rewards"),
        pytest.param(lambda t: t.update(rollout_sampling_mask_offsets=t["rollout_sampling_mask_offsets"][:-1]),
                     "rollout_sampling_mask_offsets", id="short-mask-offsets"),
        pytest.param(lambda t: t.pop("rollout_sampling_mask_offsets"), "mask ids and offsets", id="lone-mask-ids"),
        pytest.param(lambda t: t.update(tokens=t["tokens"].astype(np.int64)), "int32", id="int64-tokens"),
        pytest.param(lambda t: t.pop("partition"), "partition", id="no-partition"),
        pytest.param(lambda t: t.update(surprise=np.zeros(1, np.int64)), "surprise", id="unknown-tensor"),
        pytest.param(lambda t: t.update(response_lengths=t["response_lengths"] + 100), "response_lengths",
                     id="response-longer-than-tokens"),
    ],
)
def test_an_inconsistent_shard_is_rejected_naming_the_file(tmp_path, breakage, message):
    tensors = valid_tensors()
    breakage(tensors)
    path = save_tensors(tmp_path, tensors)
    with pytest.raises(ContractError, match=message) as info:
        load_shard(path)
    assert "broken.safetensors" in str(info.value)


def test_a_file_that_is_not_safetensors_is_a_contract_error(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00" * 3)
    with pytest.raises(ContractError, match="junk.safetensors"):
        load_shard(path)


def test_seq_must_be_a_non_negative_integer(tmp_path):
    with pytest.raises(ContractError, match="seq"):
        batch_path(tmp_path, -1)
