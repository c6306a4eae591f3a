"""rollout_bus.consumers.shard_writer.staleness: the shard writer's staleness net, and how a batch's manifest lists what it dropped."""

from __future__ import annotations

import json

import numpy as np

from rollout_bus.consumers.shard_writer.batcher import Batcher
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.consumers.shard_writer.episodes import Episode
from rollout_bus.consumers.shard_writer.out_dir import WrittenBatch, batch_metrics, manifest_extra
from rollout_bus.consumers.shard_writer.batch import split_stale
from rollout_bus.consumers.shard_writer.staleness import episode_oldest_version, is_stale
from rollout_bus.model.sample import Sample
from rollout_bus.wire.rollout_key import rollout_key_string

G = 2  # groups per batch: batch k holds group indices 2k and 2k + 1


def segment(group_index: int, rid: int, versions: list[str], token_versions=None, length: int = 2) -> Sample:
    sample = Sample(group_index=group_index, index=rid, rollout_id=rid, tokens=[1] * (length + 2),
                    response_length=length, reward=1.0, loss_mask=[1] * length, weight_versions=list(versions))
    if token_versions is not None:
        sample.rollout_token_versions = np.asarray(token_versions, dtype=np.int64)
    return sample


def episode(group_index: int, rid: int, *segments: Sample, offset: int = 0) -> Episode:
    key = rollout_key_string((None, "rollout", group_index, rid))
    return Episode(key, 0, 2, segments, 0, offset)


def batch_3(*episodes: Episode):
    """Batch 3 (groups 6 and 7, two episodes each) as the batcher forms it."""
    batcher = Batcher(RunBatching(G, "step"))
    for e in episodes:
        batcher.add(e)
    [batch] = batcher.ready()
    assert batch.seq == 3
    return batcher, batch


def test_the_oldest_version_spans_segments_and_prefers_generated_token_versions():
    two = episode(6, 0, segment(6, 0, ["3"]), segment(6, 0, ["2", "4"]))
    assert episode_oldest_version(two) == 2
    # token versions >= 0 win over weight_versions; an all -1 array falls back to weight_versions
    assert episode_oldest_version(episode(6, 0, segment(6, 0, ["0"], token_versions=[5, -1]))) == 5
    assert episode_oldest_version(episode(6, 0, segment(6, 0, ["4"], token_versions=[-1, -1]))) == 4
    assert episode_oldest_version(episode(6, 0, segment(6, 0, []), segment(6, 0, ["v1"]))) is None


def test_stale_means_older_than_the_batch_minus_the_bound_and_unversioned_is_never_stale():
    assert is_stale(1, 3, 1) and not is_stale(2, 3, 1) and not is_stale(None, 3, 0)
    assert is_stale(2, 3, 0) and not is_stale(3, 3, 0)


def test_split_moves_stale_episodes_out_keeps_order_and_offsets_and_lists_them_in_the_manifest():
    fresh = episode(6, 0, segment(6, 0, ["2"]), offset=1)                       # 2 >= 3 - 1: kept
    old = episode(6, 1, segment(6, 1, ["3"]), segment(6, 1, ["1"]), offset=2)   # 1 < 2: stale
    unversioned = episode(7, 0, segment(7, 0, []), offset=3)                    # nothing to judge: kept
    old_tokens = episode(7, 1, segment(7, 1, ["2"], token_versions=[0, 2]), offset=4)  # token 0 < 2: stale
    batcher, batch = batch_3(fresh, old, unversioned, old_tokens)

    assert split_stale(batch, None) is batch
    assert split_stale(batch, 3) is batch  # nothing older than 0
    split = split_stale(batch, 1)
    assert [e.key for e in split.episodes] == [fresh.key, unversioned.key]
    assert [(s.key, s.oldest_version, s.seq, s.max_staleness) for s in split.stale] == [
        (old.key, 1, 3, 1), (old_tokens.key, 0, 3, 1)]
    assert split.groups == batch.groups and split.abandoned == batch.abandoned
    reason = split.stale[0].reason
    for part in (old.key, "oldest weight version 1", "batch 3", "max_staleness=1", ">= 2"):
        assert part in reason, reason
    assert len(split.samples()) == 2  # only the kept episodes' segments are trained on

    # the stale ones stay members: done() releases their offsets, so commits move past them
    assert sorted(m.offset for m in split.members()) == [1, 2, 3, 4]
    batcher.done(split)
    assert batcher.commit_offsets() == {0: 5}

    extra = manifest_extra(split, batching="step", normalization="grpo", max_staleness=1)
    assert extra["max_staleness"] == 1 and [e["key"] for e in extra["episodes"]] == [fresh.key, unversioned.key]
    assert extra["stale"] == [s.as_json() for s in split.stale]
    assert extra["stale"][0] == {"key": old.key, "attempt": 0, "partition": 0, "offset": 2, "segments": 2,
                                 "oldest_version": 1, "reason": reason}
    assert extra["weight_versions"] == ["2"]  # of the episodes written
    json.dumps(extra)
    # a restart counts the stale keys as decided by the batch on disk (a re-read one is a duplicate)
    written = WrittenBatch(3, None, {"seq": 3, "extra": extra}, "sha")
    assert sorted(written.keys()) == sorted((e.key, 0) for e in (fresh, old, unversioned, old_tokens))


def test_a_batch_whose_every_episode_is_stale_is_empty():
    _, batch = batch_3(*(episode(g, r, segment(g, r, ["0"]), offset=2 * g + r) for g in (6, 7) for r in (0, 1)))
    split = split_stale(batch, 2)
    assert split.empty and len(split.stale) == 4 and len(split.members()) == 4


def test_batch_metrics_add_staleness_with_the_batch_seq_as_the_step():
    samples = [segment(6, 0, ["2"]), segment(6, 1, ["1"], length=4)]
    metrics = batch_metrics(samples, 3)
    assert metrics["staleness/mean"] == (1 * 2 + 2 * 4) / 6 and metrics["staleness/max"] == 2.0
    assert metrics["staleness/oldest"] == 2.0 and metrics["num_training_samples"] == 2
