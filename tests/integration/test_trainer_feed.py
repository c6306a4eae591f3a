"""The trainer's feed against a real broker: every batch of a pipeline run, in order, on every rank;
independent readers; a position that survives a restart; shards mounted elsewhere; clear errors."""

from __future__ import annotations

import shutil
import uuid

import pytest
import torch
from torch.utils.data import DataLoader

from rollout_bus.consumers.feed.dataset import ShardFeedDataset
from rollout_bus.consumers.feed.trainer_feed import ShardFeed
from rollout_bus.errors import ConfigError, ContractError, FeedTimeoutError
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.model.shards import load_shard
from rollout_bus.demo.run import written_batches
from rollout_bus.wire.topics import Topics
from tests.integration.pipeline_harness import run_pipeline

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def finished_run(kafka_bootstrap, tmp_path_factory):
    """One pipeline run (dp_size 2), its topic prefix, shard directory and written seqs."""
    out = tmp_path_factory.mktemp("feed-run")
    run, _ = run_pipeline(kafka_bootstrap, out, episodes=40, seed=5)
    shards = out / "shards"
    seqs = sorted(int(m["seq"]) for m in written_batches(shards).values())
    assert len(seqs) >= 4
    return run.topics.prefix, shards, seqs


def _feed(bootstrap: str, prefix: str, rank: int, **options) -> ShardFeed:
    return ShardFeed(bootstrap, rank=rank, dp_size=2, topic_prefix=prefix, timeout_s=60, **options)


def test_every_rank_gets_every_batch_in_order_with_its_own_shard_checked(kafka_bootstrap, finished_run):
    prefix, shards, seqs = finished_run
    for rank in (0, 1):
        with _feed(kafka_bootstrap, prefix, rank) as feed:
            batches = list(feed)
        assert [b.seq for b in batches] == seqs  # and the iteration ended by itself: the run is over
        for batch in batches:
            assert batch.path == shards / f"batch-{batch.seq:08d}" / f"dp-{rank:03d}.safetensors"
            on_disk = load_shard(batch.path)
            assert set(batch.tensors) == set(on_disk.tensors)
            assert all(torch.equal(batch.tensors[k], on_disk.tensors[k]) for k in on_disk.tensors)
            samples = list(batch.samples())
            assert len(samples) == len(batch) > 0
            assert all(s.rollout_sampling_mask is not None for s in samples)
            assert batch.metrics and batch.weight_versions == ["0"]  # the demo generator's policy version


def test_two_feeds_read_the_same_batches_independently_and_commit_nothing(kafka_bootstrap, finished_run):
    prefix, _, seqs = finished_run
    with _feed(kafka_bootstrap, prefix, 0) as first, _feed(kafka_bootstrap, prefix, 0) as second:
        a = [first.next_batch().seq for _ in range(2)]
        b = [batch.seq for batch in second]
        a += [batch.seq for batch in first]
    assert a == b == seqs


def test_a_restarted_feed_resumes_after_the_checkpointed_batch(kafka_bootstrap, finished_run):
    prefix, _, seqs = finished_run
    with _feed(kafka_bootstrap, prefix, 1) as feed:
        trained = [feed.next_batch().seq for _ in range(2)]
        checkpoint = feed.state_dict()
        feed.next_batch()  # trained after the checkpoint, then the trainer is killed: repeated after restart
    assert checkpoint == {"next_seq": seqs[2], "rank": 1, "dp_size": 2, "topic": f"{prefix}rollout.shards"}
    with _feed(kafka_bootstrap, prefix, 1) as restarted:
        restarted.load_state_dict(checkpoint)
        trained += [batch.seq for batch in restarted]
    assert trained == seqs
    with pytest.raises(ConfigError, match="rank"):
        _feed(kafka_bootstrap, prefix, 0).load_state_dict(checkpoint)


def test_shards_mounted_elsewhere_are_read_from_there(kafka_bootstrap, finished_run, tmp_path):
    prefix, shards, seqs = finished_run
    mounted = tmp_path / "mnt" / "rollouts"
    shutil.copytree(shards, mounted)
    with _feed(kafka_bootstrap, prefix, 0, shards_root=mounted, start=seqs[1]) as feed:
        batches = list(feed)
    assert [b.seq for b in batches] == seqs[1:]
    assert all(b.path.is_relative_to(mounted) for b in batches)


def test_a_corrupted_or_missing_shard_is_a_clear_error_naming_batch_rank_and_path(kafka_bootstrap, finished_run,
                                                                                   tmp_path):
    prefix, shards, seqs = finished_run
    mounted = tmp_path / "copy"
    shutil.copytree(shards, mounted)
    bad = mounted / f"batch-{seqs[1]:08d}" / "dp-001.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with _feed(kafka_bootstrap, prefix, 1, shards_root=mounted) as feed:
        assert feed.next_batch().seq == seqs[0]
        with pytest.raises(ContractError, match=rf"batch {seqs[1]} rank 1 at {bad}.*sha256"):
            feed.next_batch()
    (mounted / f"batch-{seqs[2]:08d}" / "dp-000.safetensors").unlink()
    with _feed(kafka_bootstrap, prefix, 0, shards_root=mounted, start=seqs[2]) as feed:
        with pytest.raises(ContractError, match=rf"shard missing: batch {seqs[2]} rank 0"):
            feed.next_batch()


def test_a_feed_with_no_batch_coming_times_out_with_a_clear_error(kafka_bootstrap, client_kwargs):
    topics = Topics(prefix=f"t{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, topics)
    with ShardFeed(kafka_bootstrap, rank=0, dp_size=2, topic_prefix=topics.prefix, timeout_s=2) as feed:
        with pytest.raises(FeedTimeoutError, match=r"rank 0: no batch \(any\) on .*rollout.shards within 2s"):
            feed.next_batch()


def test_the_dataset_feeds_a_dataloader_one_batch_per_step_and_keeps_its_position(kafka_bootstrap, finished_run):
    prefix, _, seqs = finished_run
    dataset = ShardFeedDataset(kafka_bootstrap, rank=0, dp_size=2, topic_prefix=prefix, timeout_s=60)
    seen = []
    for batch in DataLoader(dataset, batch_size=None):
        seen.append(batch.seq)
        if len(seen) == 2:
            break
    state = dataset.state_dict()
    assert seen == seqs[:2] and state["next_seq"] == seqs[2]
    resumed = ShardFeedDataset(kafka_bootstrap, rank=0, dp_size=2, topic_prefix=prefix, timeout_s=60, state=state)
    assert [b.seq for b in DataLoader(resumed, batch_size=None)] == seqs[2:]
    with pytest.raises(ConfigError, match="torch.distributed"):
        ShardFeedDataset(kafka_bootstrap, topic_prefix=prefix)


def test_bad_arguments_are_refused_by_name(kafka_bootstrap):
    for kwargs, name in (({"rank": 2, "dp_size": 2}, "rank"), ({"rank": 0, "dp_size": 0}, "dp_size"),
                         ({"rank": 0, "dp_size": 1, "start": -1}, "start")):
        with pytest.raises(ConfigError, match=name):
            ShardFeed(kafka_bootstrap, **kwargs)
