"""The whole pipeline, three stage processes on the real broker: exactly once, valid masks, replayable.

One undisturbed run is the reference; the same seed again, and runs whose stream worker or shard writer
is SIGKILLed mid-run and restarted, must write byte-identical shards.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from rollout_bus.model.metrics import compute_metrics_from_samples
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.shards import load_shard
from tests.integration.pipeline_harness import (batches_written_at_least, episodes_emitted_at_least,
                                                kill_and_restart, run_pipeline, shard_digests)

ADAPTERS = ["math", "code"]
RECOMPUTABLE = ("episode_response_length", "episode_total_response_length", "episode_raw_reward",
                "num_training_samples", "truncated_ratio", "adapter/")


@pytest.fixture(scope="module")
def reference(kafka_bootstrap, tmp_path_factory):
    return run_pipeline(kafka_bootstrap, tmp_path_factory.mktemp("reference"), adapters=",".join(ADAPTERS))


def _shard_samples(run):
    for shard_path in sorted((run.out / "shards").glob("batch-*/dp-*.safetensors")):
        for sample in load_shard(shard_path).samples():
            yield shard_path.parent.name, sample


def test_every_episode_sent_is_in_exactly_one_batch(reference):
    run, result = reference
    sent = json.loads(run.summary_path.read_text())["episodes"]
    assert result.sent == len(sent) == 24 and result.in_shards == 24 and result.in_dlq_only == 0
    batches_of = defaultdict(set)
    for batch, sample in _shard_samples(run):
        batches_of[(sample.adapter_slot, sample.group_index, sample.rollout_id)].add(batch)
    expected = {(slot if slot is not None else -1, group, ident) for (_n, slot, _k, group, ident), _a in
                ((json.loads(key), attempt) for key, attempt in sent)}
    assert set(batches_of) == expected
    assert all(len(batches) == 1 for batches in batches_of.values())


def test_shard_masks_cover_every_response_token_and_hold_the_token(reference):
    run, _ = reference
    checked_forced = checked_sampled = 0
    for _batch, sample in _shard_samples(run):
        mask = sample.rollout_sampling_mask
        assert mask is not None and len(mask) == sample.response_length
        response = np.asarray(sample.tokens)[-sample.response_length:]
        loss = np.asarray(sample.loss_mask)
        trained = loss.any()  # a removed sample has an all-zero loss mask but real supports
        for t in range(sample.response_length):
            row = mask.row(t)
            assert int(response[t]) in set(row.tolist()), f"token {t} of rollout {sample.rollout_id} not in support"
            if trained and loss[t] == 0:
                assert row.tolist() == [int(response[t])]
                checked_forced += 1
            else:
                checked_sampled += 1
    assert checked_forced > 0 and checked_sampled > 0


def test_manifest_metrics_equal_metrics_recomputed_from_the_shards(reference):
    run, _ = reference
    by_batch = defaultdict(list)
    for batch, s in _shard_samples(run):
        adapter = AdapterRef(ADAPTERS[s.adapter_slot], s.adapter_slot) if s.adapter_slot >= 0 else None
        by_batch[batch].append((s.position, Sample(
            group_index=s.group_index, index=s.sample_index, rollout_id=s.rollout_id, adapter=adapter,
            tokens=np.asarray(s.tokens), response_length=s.response_length, loss_mask=np.asarray(s.loss_mask),
            reward=float(s.raw_reward), status=Status.TRUNCATED if s.truncated else Status.COMPLETED)))
    assert by_batch
    for batch, rows in by_batch.items():
        manifest = json.loads((run.out / "shards" / batch / "manifest.json").read_text())
        recomputed = compute_metrics_from_samples([sample for _, sample in sorted(rows, key=lambda r: r[0])])
        stored = {k.removeprefix("rollout/"): v for k, v in manifest["metrics"].items()}
        keys = [k for k in recomputed if k.startswith(RECOMPUTABLE)]
        assert any(k.startswith("adapter/") for k in keys)
        for key in keys:
            assert stored[key] == pytest.approx(recomputed[key], rel=1e-6), (batch, key)


def test_the_same_seed_twice_gives_byte_identical_shards(reference, kafka_bootstrap, tmp_path):
    again, _ = run_pipeline(kafka_bootstrap, tmp_path, adapters=",".join(ADAPTERS))
    assert shard_digests(again) == shard_digests(reference[0]) != {}


def test_a_stream_worker_killed_mid_run_and_restarted_changes_no_shard(reference, kafka_bootstrap, tmp_path):
    drilled, _ = run_pipeline(kafka_bootstrap, tmp_path, adapters=",".join(ADAPTERS),
                              drill=kill_and_restart("stream", episodes_emitted_at_least(6)))
    assert shard_digests(drilled) == shard_digests(reference[0])


def test_a_shard_writer_killed_mid_run_and_restarted_changes_no_shard(reference, kafka_bootstrap, tmp_path):
    drilled, _ = run_pipeline(kafka_bootstrap, tmp_path, adapters=",".join(ADAPTERS),
                              drill=kill_and_restart("shards", batches_written_at_least(1)))
    assert shard_digests(drilled) == shard_digests(reference[0])
    assert not list((drilled.out / "shards").rglob("*.tmp"))


def test_injected_faults_land_in_the_dlq_with_reasons_and_the_run_still_accounts_for_everything(
        kafka_bootstrap, tmp_path):
    run, result = run_pipeline(kafka_bootstrap, tmp_path, inject_faults=True)
    assert result.dlq_reasons, "the injected bad records must be dead-lettered"
    assert sum(result.dlq_reasons.values()) >= 2
    # the replay gap fails its batch's mask check: it and its batch-mates are in the DLQ, and allowed there
    assert result.dlq_reasons.get("shards/mask-check", 0) >= 2 and result.in_dlq_only >= 2
    assert result.valid_in_dlq_only == {} and result.in_shards + result.in_dlq_only == result.sent == 24
    summary = json.loads(run.summary_path.read_text())
    assert summary["end_of_run_partitions"] == run.topics.turns_partitions and len(summary["run_id"]) == 32


def test_a_valid_episode_that_ends_only_in_the_dlq_fails_the_reconciliation(kafka_bootstrap, tmp_path):
    """The same faults, judged as if none had been injected: the mask-check batch-mates are valid episodes lost."""
    from rollout_bus.observe.accounting import reconcile
    from rollout_bus.kafka.reader import TopicWatcher

    run, _ = run_pipeline(kafka_bootstrap, tmp_path, inject_faults=True, seed=11)
    watcher = TopicWatcher(run.kwargs, [], [run.topics.dlq])
    try:
        watcher.catch_up()
        letters = watcher.dead_letters(run.topics.dlq)
    finally:
        watcher.close()
    judged = reconcile(run._sent(), run.out / "shards", letters, verify=False, faults=None)
    assert not judged.ok and len(judged.valid_in_dlq_only) >= 1
    assert any("valid episodes only in the DLQ" in p for p in judged.problems())
