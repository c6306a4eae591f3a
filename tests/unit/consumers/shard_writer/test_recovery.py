"""rollout_bus.consumers.shard_writer.recovery: a restarted writer's start-up, from the disk and rollout.shards."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from rollout_bus.kafka import reader as kafka_reader
from rollout_bus.errors import Unavailable
from rollout_bus.kafka.retry import retrying
from rollout_bus.consumers.shard_writer import recovery
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.consumers.shard_writer.batcher import Batcher, Outcome
from rollout_bus.consumers.shard_writer.decide import decide, write_decided
from rollout_bus.consumers.shard_writer.out_dir import announced_ids, announcement
from tests.unit.consumers.shard_writer.test_decide import episode


@dataclass
class Counts:
    batches_found: int = 0
    batches_reannounced: int = 0


def write_batches(out, seqs):
    """Batches ``seqs`` of one group each (G=1), written as the writer writes them; their announcements."""
    batcher = Batcher(RunBatching(1, "step"))
    values = {}
    for seq in seqs:
        for rid in (0, 1):
            batcher.add(episode(seq, rid))
        [batch] = batcher.ready()
        decision = decide(batch, dp_size=1, normalization="grpo", batching="step")
        manifest = write_decided(out, decision, topic="rollout.episodes")
        values[seq] = announcement(manifest, out / f"batch-{seq:08d}")
    return values


def test_nothing_on_disk_reads_nothing_from_rollout_shards(tmp_path):
    def never():
        raise AssertionError("rollout.shards read with no batch on disk")
    counts = Counts()
    found = recovery.recover(tmp_path, Batcher(RunBatching(1)), read_announced=never, announce=None, counts=counts)
    assert found == [] and counts == Counts()


def test_batches_on_disk_are_marked_written_and_only_the_unannounced_ones_announced(tmp_path):
    values = write_batches(tmp_path, [0, 1, 2])
    (tmp_path / "batch-00000001" / ".dp-000.safetensors.tmp").write_bytes(b"half")  # a killed write
    (tmp_path / "batch-00000003").mkdir()  # a batch killed before its manifest
    (tmp_path / "batch-00000003" / "dp-000.safetensors").write_bytes(b"partial")
    announced, counts, batcher = [], Counts(), Batcher(RunBatching(1))

    found = recovery.recover(tmp_path, batcher, counts=counts,
                             read_announced=lambda: announced_ids([values[1], None, b"junk"]),
                             announce=lambda seq, manifest, directory: announced.append((seq, directory.name)))

    assert [b.seq for b in found] == [0, 1, 2]
    assert announced == [(0, "batch-00000000"), (2, "batch-00000002")]
    assert counts == Counts(batches_found=3, batches_reannounced=2)
    assert not (tmp_path / "batch-00000003").exists()
    assert not (tmp_path / "batch-00000001" / ".dp-000.safetensors.tmp").exists()
    assert batcher.add(episode(1, 0)).outcome is Outcome.DUPLICATE  # re-read from the committed offsets
    assert batcher.next_seq == 3


class FakeReader:
    """A TopicReader whose first ``fails`` reads stall (the broker is away)."""

    fails = 2
    opened: list = []

    def __init__(self, conn, names):
        self.names, self.closed = names, False
        FakeReader.opened.append(self)

    def read_to_end(self, timeout_s=30.0, *, stall_s=None):
        assert stall_s == recovery.STALL_S
        if len(FakeReader.opened) <= FakeReader.fails:
            raise Unavailable("no record from rollout.shards for 10s before their end offsets")
        return {self.names[0]: [SimpleNamespace(value=v) for v in self.values]}

    def close(self):
        self.closed = True


def test_announcements_are_read_to_the_end_through_broker_outages_with_a_fresh_reader_each_time(tmp_path,
                                                                                                monkeypatch):
    values = write_batches(tmp_path, [0, 1])
    FakeReader.opened, FakeReader.values = [], [values[0], None, values[1]]
    monkeypatch.setattr(kafka_reader, "TopicReader", FakeReader)  # read_topic builds one per try
    waits = []

    def retry(operation, what):
        assert what == "read announcements from rollout.shards"
        return retrying(operation, what, sleep=lambda s: None, on_retry=lambda n, exc: waits.append(n))

    found = recovery.announced_on({"bootstrap_servers": "x"}, "p.rollout.shards", retry)
    assert found == announced_ids([values[0], values[1]])
    assert sorted(name for name, _ in found) == ["batch-00000000", "batch-00000001"]
    assert waits == [1, 2] and len(FakeReader.opened) == 3
    assert all(r.closed and r.names == ["p.rollout.shards"] for r in FakeReader.opened)


def test_an_output_directory_holding_another_runs_batches_is_refused_before_anything_is_announced(tmp_path):
    import pytest

    from rollout_bus.errors import ConfigError

    write_batches(tmp_path, [0, 1])  # their episodes came from rollout.episodes (no prefix)
    announced, counts, batcher = [], Counts(), Batcher(RunBatching(1))
    with pytest.raises(ConfigError, match=r"another run: batch 0's episodes came from rollout\.episodes, this "
                                          r"writer reads run7\.rollout\.episodes"):
        recovery.recover(tmp_path, batcher, counts=counts, read_announced=lambda: set(),
                         announce=lambda *a: announced.append(a), topic="run7.rollout.episodes")
    assert announced == [] and counts == Counts() and batcher.next_seq == 0
    # its own run's writer adopts them as before
    found = recovery.recover(tmp_path, batcher, counts=counts, read_announced=lambda: set(),
                             announce=lambda *a: announced.append(a), topic="rollout.episodes")
    assert [b.seq for b in found] == [0, 1] and len(announced) == 2
