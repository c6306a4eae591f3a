"""The shard writer and the control records, against a real broker: abandoned episodes complete their
groups, end-of-run markers close the last batch, and a DLQ copy over the size limit goes by reference.

Batch boundaries here follow from the log alone; no test waits on a clock for a batch to form.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from rollout_bus.consumers.shard_writer.writer import ShardWriter
from rollout_bus.consumers.shard_writer.options import WriterOptions
from rollout_bus.consumers.feed.trainer_feed import ShardFeed
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.wire.positions import RangeStart
from rollout_bus.replay.rerun import replay
from rollout_bus.wire.control_records import Abandoned
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.topics import Topics
from rollout_bus.wire.rollout_key import rollout_key_string
from rollout_bus.wire.run_record import RunBatching
from tests.integration.test_shard_writer import (ADAPTERS, GROUP_SIZE, end_of_run, make_episode, manifests, publish,
                                                 read_topic, run_writer)

pytestmark = pytest.mark.kafka


def make_abandoned(group_index: int, rid: int, *, attempt: int = 0):
    """The ``abandoned`` record the stream stage sends for an episode whose final turn it dead-lettered."""
    key = rollout_key_string((ADAPTERS[group_index % len(ADAPTERS)], "rollout", group_index, rid)).encode()
    marker = Abandoned(attempt, GROUP_SIZE, "merge", f"turn 2 of rollout {rid} does not extend turn 1",
                       f"rollout.turns:0:{100 * group_index + rid}")
    return key, marker.value(), marker.headers()


def shard_digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("batch-*/dp-*.safetensors"))}


def fresh_topics(client_kwargs, dlq_max_bytes: int | None = None) -> Topics:
    topics = Topics(prefix=f"t{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, topics)
    if dlq_max_bytes is not None:  # lowered after ensure_topics, which only ever raises a topic's limit
        admin = KafkaAdminClient(**client_kwargs)
        try:
            admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topics.dlq,
                                                configs={"max.message.bytes": str(dlq_max_bytes)})])
        finally:
            admin.close()
    return topics


class WriterThread:
    """A ShardWriter running in a thread (so a test can watch its stats, or make it crash)."""

    def __init__(self, client_kwargs, topics, out: Path, group_id: str, cls=ShardWriter, **options) -> None:
        opts = {"dp_size": 2, "run_batching": RunBatching(2), "group_id": group_id, "exit_on_end_of_run": True,
                **options}
        self.writer = cls(client_kwargs, topics, WriterOptions(out_dir=out, **opts))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.writer.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def wait_until(self, condition, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.05)

    def join(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.writer.stop()
            self.thread.join(30)
            pytest.fail("the writer did not stop by itself")


# ---------------------------------------------------------------------------- abandoned episodes


def _abandoned_run_records(abandoned_first: bool):
    """Ranges (G=2): 0 = groups 0, 1 with rollout (1, 2) abandoned; 1 = groups 2, 3; 2 = groups 4, 5 all
    abandoned (no batch); 3 = groups 6, 7; then group 8 short of one episode (the last, partial batch).
    A duplicate abandoned record rides along."""
    gone = {(1, 2)} | {(g, r) for g in (4, 5) for r in range(GROUP_SIZE)}
    episodes = [make_episode(g, r) for g in range(8) for r in range(GROUP_SIZE) if (g, r) not in gone]
    episodes += [make_episode(8, 0), make_episode(8, 1)]
    abandoned = [make_abandoned(g, r) for g, r in sorted(gone)] + [make_abandoned(1, 2)]
    return abandoned + episodes if abandoned_first else episodes + abandoned


def test_abandoned_records_complete_groups_are_listed_in_manifests_and_order_does_not_matter(client_kwargs,
                                                                                              kafka_bootstrap,
                                                                                              tmp_path):
    outs, all_topics = {}, {}
    for abandoned_first in (True, False):
        topics = all_topics[abandoned_first] = fresh_topics(client_kwargs)
        markers = end_of_run(topics) + end_of_run(topics, only={(0, 1), (1, 3)})  # duplicated markers too
        publish(client_kwargs, topics.episodes, _abandoned_run_records(abandoned_first) + markers)
        out = outs[abandoned_first] = tmp_path / f"abandoned-first-{abandoned_first}"
        run_writer(kafka_bootstrap, topics, out)
        assert read_topic(client_kwargs, topics.dlq) == []  # nothing late, nothing rejected

    assert shard_digests(outs[True]) == shard_digests(outs[False])
    written = manifests(outs[True])
    assert [m["seq"] for m in written] == [0, 1, 3, 4]  # range 2 was all abandoned: its seq is absent
    assert [m["extra"]["partial"] for m in written] == [False, False, False, True]
    [entry] = written[0]["extra"]["abandoned"]
    assert (entry["key"], entry["attempt"], entry["kind"], entry["source"]) == (
        make_abandoned(1, 2)[0].decode(), 0, "merge", "rollout.turns:0:102")
    assert "does not extend" in entry["reason"]
    groups = {g["group_index"]: (g["episodes"], g["abandoned"], g["complete"]) for g in written[0]["extra"]["groups"]}
    assert groups == {0: (3, 0, True), 1: (2, 1, True)}
    assert written[0]["num_samples"] == sum(2 if r % 3 == 1 else 1 for g in (0, 1) for r in range(3) if (g, r) != (1, 2))
    for manifest in manifests(outs[False]):
        assert [e["key"] for e in manifest["extra"]["abandoned"]] == [
            e["key"] for e in next(m for m in written if m["seq"] == manifest["seq"])["extra"]["abandoned"]]

    # a replay of the log reaches the same decisions: the same batches, byte for byte, manifests included
    report = replay(client_kwargs, [RangeStart(all_topics[False].episodes)], out_dir=tmp_path / "replayed",
                    compare_dir=outs[False])
    assert {b.seq: b.status for b in report.batches} == {0: "identical", 1: "identical", 3: "identical",
                                                          4: "identical"}
    assert shard_digests(tmp_path / "replayed") == shard_digests(outs[False])
    for seq in (0, 1, 3, 4):
        name = f"batch-{seq:08d}/manifest.json"
        assert (tmp_path / "replayed" / name).read_bytes() == (outs[False] / name).read_bytes()

    # rollout.shards says seq 2 will never come and when the run is over: a trainer's feed passes over
    # the gap and stops at the end instead of waiting
    shards = read_topic(client_kwargs, all_topics[False].shards)
    controls = [(control_kind(r.headers), json.loads(r.value)) for r in shards if control_kind(r.headers)]
    assert [(kind, doc.get("seq"), doc.get("why"), doc.get("next_seq")) for kind, doc in controls] == [
        ("batch-skipped", 2, "empty", None), ("end-of-run", None, None, 5)]
    with ShardFeed(kafka_bootstrap, rank=1, dp_size=2, topic_prefix=all_topics[False].prefix, timeout_s=30) as feed:
        assert [batch.seq for batch in feed] == [0, 1, 3, 4]


# ---------------------------------------------------------------------------- end of run


def test_the_last_partial_batch_waits_for_every_partitions_end_of_run_marker(client_kwargs, topics, tmp_path):
    first = [make_episode(g, r) for g in range(2) for r in range(GROUP_SIZE)] + [make_episode(2, 0)]
    last_pair = (1, topics.episodes_partitions - 1)
    early = end_of_run(topics, only={(t, p) for t in (0, 1) for p in range(topics.episodes_partitions)} - {last_pair})
    publish(client_kwargs, topics.episodes, first + early)
    writer = WriterThread(client_kwargs, topics, tmp_path, uuid.uuid4().hex)
    writer.wait_until(lambda: writer.writer.stats.records == len(first + early), "every record was read")
    writer.wait_until(lambda: writer.writer.stats.batches_written == 1, "batch 0 was written")
    assert writer.thread.is_alive() and writer.writer.stats.runs_ended == 0
    assert [m["seq"] for m in manifests(tmp_path)] == [0]  # one marker short: group 2 still waits

    publish(client_kwargs, topics.episodes, end_of_run(topics, only={last_pair}))
    writer.join()
    assert writer.error is None and writer.writer.stats.runs_ended == 1
    written = manifests(tmp_path)
    assert [(m["seq"], m["extra"]["partial"]) for m in written] == [(0, False), (1, True)]
    assert [g["episodes"] for g in written[1]["extra"]["groups"]] == [1]


class _Crash(Exception):
    pass


class CrashBeforeTheFlush(ShardWriter):
    """Every marker arrived, the process dies before the last batch is written."""

    def _end_run(self, run: str) -> None:
        raise _Crash(run)


def test_a_writer_restarted_between_end_of_run_and_its_flush_reads_the_markers_again(client_kwargs, topics,
                                                                                      tmp_path):
    records = [make_episode(g, r) for g in range(3) for r in range(GROUP_SIZE)] + end_of_run(topics)
    publish(client_kwargs, topics.episodes, records)
    group_id = uuid.uuid4().hex
    crashed = WriterThread(client_kwargs, topics, tmp_path, group_id, cls=CrashBeforeTheFlush)
    crashed.join()
    assert isinstance(crashed.error, _Crash) and [m["seq"] for m in manifests(tmp_path)] == [0]

    restarted = WriterThread(client_kwargs, topics, tmp_path, group_id)
    restarted.join()
    assert restarted.error is None and restarted.writer.stats.runs_ended == 1
    assert restarted.writer.stats.batches_found == 1 and restarted.writer.stats.batches_written == 1
    assert [(m["seq"], m["extra"]["partial"]) for m in manifests(tmp_path)] == [(0, False), (1, True)]
    shards = read_topic(client_kwargs, topics.shards)
    announced = [json.loads(r.value)["seq"] for r in shards if control_kind(r.headers) is None]
    assert sorted(announced) == [0, 1]
    assert [json.loads(r.value)["next_seq"] for r in shards if control_kind(r.headers) == "end-of-run"] == [2]


# ---------------------------------------------------------------------------- record sizes


def test_a_dead_letter_too_large_for_the_dlq_is_sent_by_reference(client_kwargs, kafka_bootstrap, tmp_path):
    topics = fresh_topics(client_kwargs, dlq_max_bytes=64 * 1024)
    big = os.urandom(300_000)  # incompressible: over the DLQ's limit even with lz4
    publish(client_kwargs, topics.episodes, [(b"broken-big", big, [("schema", b"1")]),
                                             (b"broken-small", b"\x00not an episode", [])] + end_of_run(topics))
    run_writer(kafka_bootstrap, topics, tmp_path)

    letters = {d.key: d for d in (DeadLetter.from_record(r.key, r.value, r.headers)
                                  for r in read_topic(client_kwargs, topics.dlq))}
    assert set(letters) == {b"broken-big", b"broken-small"}
    ref = letters[b"broken-big"]
    assert ref.value is None and ref.kind == "too_large" and ref.stage == "shards"
    assert ref.source.startswith(f"{topics.episodes}:") and ref.headers == [("schema", b"1")]
    assert "300000 bytes" in ref.reason and f"the original is at {ref.source}" in ref.reason
    assert "does not decode" in ref.reason
    assert letters[b"broken-small"].kind == "decode" and letters[b"broken-small"].value == b"\x00not an episode"


# ---------------------------------------------------------------------------- bounded memory


def test_a_duplicate_of_a_batch_the_writer_no_longer_remembers_is_found_on_disk_and_dropped(client_kwargs, topics,
                                                                                           tmp_path):
    publish(client_kwargs, topics.episodes, [make_episode(g, r) for g in range(6) for r in range(GROUP_SIZE)])
    writer = WriterThread(client_kwargs, topics, tmp_path, uuid.uuid4().hex, written_memory=1)
    writer.wait_until(lambda: writer.writer.stats.batches_written == 3, "batches 0-2 are written")
    assert writer.writer._batcher.remembered_keys == 2 * GROUP_SIZE  # batch 2 only: 0 and 1 are forgotten

    publish(client_kwargs, topics.episodes, [make_episode(0, 1), make_episode(2, 5)] + end_of_run(topics))
    writer.join()
    assert writer.error is None and writer.writer.stats.duplicates == 1
    dead = [DeadLetter.from_record(r.key, r.value, r.headers) for r in read_topic(client_kwargs, topics.dlq)]
    assert [(d.key, d.kind) for d in dead] == [(make_episode(2, 5)[0], "late")]  # not in batch 1: genuinely late
    assert [m["seq"] for m in manifests(tmp_path)] == [0, 1, 2]
