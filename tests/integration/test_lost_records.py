"""Records deleted before a stage read them (retention shorter than its delay, or deleted by hand) are said,
dead-lettered as ``lost`` with topic, partition, offsets and count, and never awaited: the run goes on.

The loss is made with Kafka's own DeleteRecords (what retention does to a partition's log start, without
waiting for a clock): before a fresh stream worker starts, under a stopped one that already holds a
position, and before a fresh shard writer starts; and a writer whose end-of-run markers were deleted with the
rest ends the run from what the log still holds, exiting 65 with the ranges, instead of waiting for them.
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
from kafka import TopicPartition
from kafka.admin import KafkaAdminClient

from rollout_bus.consumers.shard_writer.lost_markers import EXIT_RECORDS_LOST
from rollout_bus.wire.control_records import END_OF_RUN_KEY, BatchesEnded
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.headers import CONTROL_END_OF_RUN, control_kind
from tests.integration.test_shard_writer import (GROUP_SIZE, REPO, end_of_run, make_episode, manifests, publish,
                                                 read_topic, run_writer, writer_command)
from tests.integration.test_stream_worker import Reader, Worker, _expected_episodes, _generated, _publish
from tests.integration.test_stream_worker import _keys as _all_keys
from tests.topic_offsets import end_offsets

pytestmark = pytest.mark.kafka


def _delete_below(kafka_bootstrap, topic, partition, offset) -> None:
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.delete_records({TopicPartition(topic, partition): offset})
    finally:
        admin.close()


def _keys(records) -> set[tuple[bytes, int]]:
    """(key, attempt) of the episode records (not the abandoned or end-of-run control records)."""
    return _all_keys([r for r in records if control_kind(r.headers) is None])


def _lost_letters(records) -> list[tuple[str, str, int]]:
    letters = [DeadLetter.from_record(r.key, r.value, r.headers) for r in records]
    return [(d.stage, d.source, d.lost) for d in letters if d.kind == "lost"]


def _keys_at(kafka_bootstrap, topic, partition, below) -> set[bytes]:
    return {r.key for r in read_topic({"bootstrap_servers": kafka_bootstrap}, topic)
            if r.partition == partition and r.offset < below}


def test_turns_deleted_before_a_fresh_worker_read_them_are_reported_lost_and_the_rest_merge(
        kafka_bootstrap, topics, tmp_path):
    turns = _generated(8, seed=11)
    _publish(kafka_bootstrap, topics, turns)
    partition = max(end_offsets(kafka_bootstrap, topics.turns).items(), key=lambda kv: kv[1])[0]
    gone = 3
    touched = _keys_at(kafka_bootstrap, topics.turns, partition, gone)
    _delete_below(kafka_bootstrap, topics.turns, partition, gone)
    expected = {k for k in _expected_episodes(turns) if k[0] not in touched}
    worker = Worker(kafka_bootstrap, topics, f"lost-{uuid.uuid4().hex[:8]}", tmp_path)
    episodes, dlq = Reader(kafka_bootstrap, topics.episodes), Reader(kafka_bootstrap, topics.dlq)
    try:
        assert _keys(episodes.until(lambda rs: _keys(rs) >= expected)) >= expected, worker.log()
        lost = _lost_letters(dlq.until(lambda rs: _lost_letters(rs)))
        assert lost == [("stream", f"{topics.turns}:{partition}:0", gone)], worker.log()
        assert not _keys(episodes.records) & {(k, a) for k, a in _expected_episodes(turns) if k in touched}
    finally:
        episodes.close()
        dlq.close()
        assert worker.stop() == 0
    line = next(line for line in worker.log().splitlines() if "LOST" in line)
    assert f"{topics.turns} partition {partition}: offsets 0..{gone - 1} ({gone} records)" in line, line
    assert worker.counts()["records_lost"] == gone and "Traceback" not in worker.log()


def test_turns_that_expire_under_a_stopped_worker_are_reported_lost_once_and_never_awaited(
        kafka_bootstrap, topics, tmp_path):
    app_id = f"lost-{uuid.uuid4().hex[:8]}"
    first = _generated(4, seed=12)
    _publish(kafka_bootstrap, topics, first)
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path, name="first")
    episodes = Reader(kafka_bootstrap, topics.episodes)
    try:
        episodes.until(lambda rs: _keys(rs) >= set(_expected_episodes(first)))
    finally:
        assert worker.stop() == 0
    before = end_offsets(kafka_bootstrap, topics.turns)
    later = _generated(4, seed=13)
    for sample, _ in later:  # other rollout ids: new episodes
        sample.rollout_id += 100
        sample.index += 100
    _publish(kafka_bootstrap, topics, later)
    after = end_offsets(kafka_bootstrap, topics.turns)
    for partition, end in after.items():  # everything the stopped worker had not read expires
        _delete_below(kafka_bootstrap, topics.turns, partition, end)
    restarted = Worker(kafka_bootstrap, topics, app_id, tmp_path, name="second")
    dlq = Reader(kafka_bootstrap, topics.dlq)
    grown = {p: (before[p], end) for p, end in after.items() if end > before[p]}
    try:
        lost = _lost_letters(dlq.until(lambda rs: len(_lost_letters(rs)) >= len(grown)))
        time.sleep(6.0)  # two of the idle timer's rounds: the lost offsets are not reported or read again
        lost = _lost_letters(dlq.until(lambda rs: False, timeout_s=1.0))
    finally:
        dlq.close()
        episodes.close()
        assert restarted.stop() == 0
    assert sorted(lost) == sorted(("stream", f"{topics.turns}:{p}:{start}", end - start)
                                  for p, (start, end) in grown.items()), restarted.log()
    assert restarted.counts()["records_lost"] == sum(end - start for start, end in grown.values())
    assert "never delivered" not in restarted.log().split("LOST")[-1]  # no endless catch-up loop after it


def test_episodes_deleted_before_a_fresh_writer_read_them_are_reported_lost_and_the_run_still_ends(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics.episodes, [make_episode(g, r) for g in range(4) for r in range(GROUP_SIZE)])
    ends = end_offsets(kafka_bootstrap, topics.episodes)
    partition = max(ends, key=ends.get)
    _delete_below(kafka_bootstrap, topics.episodes, partition, 2)
    publish(client_kwargs, topics.episodes, end_of_run(topics))
    out = tmp_path / "shards"
    done = run_writer(kafka_bootstrap, topics, out)
    lost = _lost_letters(read_topic(client_kwargs, topics.dlq))
    assert lost == [("shards", f"{topics.episodes}:{partition}:0", 2)]
    line = next(line for line in done.stderr.splitlines() if "LOST" in line)
    assert f"{topics.episodes} partition {partition}: offsets 0..1 (2 records)" in line, line
    written = sum(len(m["extra"]["episodes"]) for m in manifests(out))
    assert written == 4 * GROUP_SIZE - 2


def _writer_ending_on_loss(kafka_bootstrap, topics, out):
    """The writer with --exit-on-end-of-run, given far longer than it needs: it must end by itself."""
    began = time.monotonic()
    done = subprocess.run(writer_command(kafka_bootstrap, topics, out, uuid.uuid4().hex), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - began


def _verdict(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if "run ended with records lost" in line)


def test_a_writer_whose_end_of_run_markers_were_deleted_with_everything_ends_the_run_naming_every_range(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics.episodes, [make_episode(g, r) for g in range(4) for r in range(GROUP_SIZE)])
    publish(client_kwargs, topics.episodes, end_of_run(topics))
    ends = end_offsets(kafka_bootstrap, topics.episodes)
    for partition, end in ends.items():  # retention took every record, the markers among them
        _delete_below(kafka_bootstrap, topics.episodes, partition, end)
    done, took_s = _writer_ending_on_loss(kafka_bootstrap, topics, tmp_path / "shards")
    assert done.returncode == EXIT_RECORDS_LOST, done.stderr[-3000:]
    verdict = _verdict(done.stderr)
    assert f"{len(ends)} ranges, {sum(ends.values())} records" in verdict, verdict
    for partition, end in ends.items():
        assert f"{topics.episodes} partition {partition}: offsets 0..{end - 1} ({end} records)" in verdict, verdict
    assert "Traceback" not in done.stderr and took_s < 45, took_s
    assert sorted(_lost_letters(read_topic(client_kwargs, topics.dlq))) == sorted(
        ("shards", f"{topics.episodes}:{p}:0", end) for p, end in ends.items())
    assert not manifests(tmp_path / "shards")


def test_markers_deleted_on_one_partition_end_the_run_with_what_the_others_still_hold(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics.episodes, [make_episode(g, r) for g in range(4) for r in range(GROUP_SIZE)])
    publish(client_kwargs, topics.episodes, end_of_run(topics))
    ends = end_offsets(kafka_bootstrap, topics.episodes)
    partition = max(ends, key=ends.get)
    gone = _keys_at(kafka_bootstrap, topics.episodes, partition, ends[partition])
    _delete_below(kafka_bootstrap, topics.episodes, partition, ends[partition])  # its markers went too
    out = tmp_path / "shards"
    done, _ = _writer_ending_on_loss(kafka_bootstrap, topics, out)
    assert done.returncode == EXIT_RECORDS_LOST, done.stderr[-3000:]
    assert (f"1 ranges, {ends[partition]} records deleted" in _verdict(done.stderr)
            and f"partition {partition}: offsets 0..{ends[partition] - 1}" in _verdict(done.stderr)), done.stderr
    written = sum(len(m["extra"]["episodes"]) for m in manifests(out))
    assert written == 4 * GROUP_SIZE - len(gone - {END_OF_RUN_KEY})  # the survivors, flushed as the markers would
    shards = read_topic(client_kwargs, topics.shards)
    ended = [BatchesEnded.from_value(r.value) for r in shards if control_kind(r.headers) == CONTROL_END_OF_RUN]
    assert [e.run for e in ended] == ["run-1"] and ended[0].next_seq == len(manifests(out)), done.stderr[-3000:]
