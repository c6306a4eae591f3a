"""`rollout-bus tail --once --json` and `rollout-bus exporter` read what the stages write, on a real broker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata
from prometheus_client.parser import text_string_to_metric_families

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.wire.metrics_records import batch_metrics_record, window_metrics_record
from rollout_bus.wire.weight_version import WEIGHTS_KEY, WeightVersion
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.kafka.run_record import check_run_batching
from rollout_bus.wire.run_record import RunBatching
from tests.integration.pipeline_harness import run_pipeline

STREAM_GROUP = "ops-test-stream"
SHARDS_GROUP = "ops-test-shards"


def _stats(adapter: str, lengths: list[int]) -> EpisodeStats:
    stats = EpisodeStats()
    for i, length in enumerate(lengths):
        stats.add_episode([Sample(group_index=0, index=i, rollout_id=i, tokens=[1] * (length + 1),
                                  response_length=length, reward=1.0, status=Status.COMPLETED,
                                  adapter=AdapterRef(adapter, 0))])
    return stats


def _window(adapter: str, partition: int, lengths: list[int], closed: bool = False) -> bytes:
    stats = _stats(adapter, lengths)
    return window_metrics_record(60_000, 120_000, adapter, stats.metrics(), episodes=stats.episodes,
                                 closed=closed, partition=partition, offset=len(lengths), stats=stats.to_json())


def _dead_letter(stage: str, kind: str, adapter: str) -> DeadLetter:
    key = json.dumps([adapter, 0, "rollout", 0, 1], separators=(",", ":")).encode()
    return DeadLetter(key, b"payload", [("turn", b"0")], f"{kind} failed", stage, kind, "t:0:0")


def _publish_run(kwargs: dict, topics) -> None:
    """What the stages would have written: window partials, batch metrics, dead letters, committed offsets."""
    producer = KafkaProducer(**kwargs)
    for value in [_window("math", 0, [3]), _window("math", 0, [3, 9], closed=True), _window("math", 1, [5]),
                  _window("code", 2, [4, 4, 4])]:
        producer.send(topics.metrics, key=b"window:60000-120000", value=value)
    for seq in (0, 1, 1):  # batch 1 announced twice, as after a writer killed between announcements
        producer.send(topics.metrics, key=str(seq).encode(),
                      value=batch_metrics_record(seq, {"response_len/mean": 10.0 + seq,
                                                       "adapter/math/staleness/mean": 0.5 + seq,
                                                       "adapter/math/staleness/max": 1.0 + seq}, samples=8,
                                                 manifest_path=f"/out/batch-{seq}/manifest.json"))
    for version in (1, 2):  # the trainer's live version: 2
        producer.send(topics.weights, key=WEIGHTS_KEY, value=WeightVersion(version, version - 1, 1).value())
    for letter in [_dead_letter("stream", "decode", "math"), _dead_letter("stream", "decode", "code"),
                   _dead_letter("shards", "mask-check", "math")]:
        producer.send(topics.dlq, key=letter.key, value=letter.value, headers=letter.record_headers())
    for i in range(10):
        producer.send(topics.turns, key=b"k", value=b"t", partition=0)
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(**kwargs, group_id=topics.group(STREAM_GROUP), enable_auto_commit=False)
    consumer.commit({TopicPartition(topics.turns, 0): OffsetAndMetadata(7, "", -1)})
    consumer.close()


def _cli(module: str, kwargs: dict, topics, *extra: str) -> list[str]:
    return [sys.executable, "-m", f"rollout_bus.cli.{module}", "--bootstrap-servers", kwargs["bootstrap_servers"],
            "--topic-prefix", topics.prefix, "--stream-group", STREAM_GROUP, "--shards-group", SHARDS_GROUP, *extra]


def _tail_once(kwargs: dict, topics, *extra: str) -> dict:
    done = subprocess.run(_cli("tail", kwargs, topics, "--once", "--json", *extra), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_tail_once_json_merges_window_partials_and_counts_batches_dead_letters_and_lag(client_kwargs, topics):
    _publish_run(client_kwargs, topics)
    snapshot = _tail_once(client_kwargs, topics)
    windows = {w["adapter"]: w for w in snapshot["windows"]}
    assert windows["math"]["episodes"] == 3 and windows["math"]["partitions"] == [0, 1]
    assert windows["math"]["metrics"] == {f"rollout/{k}": v for k, v in _stats("math", [3, 9, 5]).metrics().items()}
    assert not windows["math"]["closed"] and windows["code"]["episodes"] == 3
    assert snapshot["batch"]["batch"] == 1 and snapshot["batches"] == 2 and snapshot["batch_samples"] == 16
    assert snapshot["dlq"]["by_reason"] == [{"stage": "shards", "kind": "mask-check", "count": 1},
                                            {"stage": "stream", "kind": "decode", "count": 2}]
    lag = {(r["group"], r["topic"], r["partition"]): r for r in snapshot["lag"]}
    stream_group, shards_group = topics.group(STREAM_GROUP), topics.group(SHARDS_GROUP)  # scoped by the prefix
    assert lag[(stream_group, topics.turns, 0)]["lag"] == 3 and lag[(stream_group, topics.turns, 0)]["end"] == 10
    assert lag[(shards_group, topics.episodes, 0)] == {"group": shards_group, "topic": topics.episodes,
                                                       "partition": 0, "committed": None, "end": 0, "lag": 0,
                                                       "log_start": 0, "lost": 0, "near_log_start": False}
    assert snapshot["trainer"]["weight_version"] == 2 and snapshot["trainer"]["step"] == 1
    assert snapshot["staleness"] == [{"adapter": "math", "mean": 1.5, "max": 2.0, "oldest": None}]

    only_math = _tail_once(client_kwargs, topics, "--adapter", "math")
    assert [w["adapter"] for w in only_math["windows"]] == ["math"] and only_math["dlq"]["counted"] == 2
    recent = _tail_once(client_kwargs, topics, "--history", "2")
    # the last 2 records of each partition: batch 1 (twice) on rollout.metrics, the last 2 dead letters
    assert recent["windows"] == [] and recent["batches"] == 1 and recent["dlq"]["counted"] == 2
    assert recent["dlq"]["on_topic"] == 3


def test_tail_shows_a_dash_for_the_trainer_version_when_rollout_weights_does_not_exist(client_kwargs, topics):
    _publish_run(client_kwargs, topics)
    admin = KafkaAdminClient(**client_kwargs)
    try:
        admin.delete_topics([topics.weights])
    finally:
        admin.close()
    consumer, deadline = KafkaConsumer(**client_kwargs), time.monotonic() + 30
    try:
        while topics.weights in consumer.topics():
            assert time.monotonic() < deadline, "the topic was not deleted"
            time.sleep(0.2)
    finally:
        consumer.close()
    snapshot = _tail_once(client_kwargs, topics)
    assert snapshot["trainer"] == {"weight_version": None, "step": None, "published_at": None}
    assert snapshot["batches"] == 2
    done = subprocess.run(_cli("tail", client_kwargs, topics, "--once"), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "trainer weight version -; staleness of batch 1" in done.stdout


def test_tail_without_a_terminal_prints_a_snapshot_every_interval_instead_of_drawing_nothing(client_kwargs, topics):
    _publish_run(client_kwargs, topics)
    proc = subprocess.Popen(_cli("tail", client_kwargs, topics, "--interval", "0.5"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(6)
    finally:
        proc.send_signal(2)  # Ctrl-C, as a person stops it
        output, _ = proc.communicate(timeout=30)
    assert output.count("latest window per adapter") >= 2, output
    assert "dead letters (3 read" in output and "mask-check" in output


def _scrape(url: str) -> dict[str, float]:
    """Sample values by ``name{label="value",...}`` with the labels sorted, however the server orders them."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            series[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return series


def _start_exporter(kwargs: dict, topics) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(_cli("exporter", kwargs, topics, "--port", "0", "--interval", "0.5"),
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        found = re.search(r"serving (http://\S+/metrics)", line)
        if found:
            return proc, found.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"exporter did not start: {proc.stderr.read()}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_the_exporter_serves_metrics_counters_and_lag_and_keeps_its_counts_across_a_restart(client_kwargs, topics):
    _publish_run(client_kwargs, topics)
    proc, url = _start_exporter(client_kwargs, topics)
    try:
        series = _scrape(url)
        assert series['rollout_episode_response_length_max{adapter="math",kind="window"}'] == 9.0
        assert series['rollout_episode_response_length_mean{adapter="code",kind="window"}'] == 4.0
        assert series['rollout_response_len_mean{adapter="",kind="batch"}'] == 11.0
        assert series['rollout_staleness_max{adapter="math",kind="batch"}'] == 2.0
        assert series["rollout_trainer_weight_version"] == 2.0
        assert series['rollout_episodes_total{adapter="math"}'] == 3.0 and series["rollout_batches_total"] == 2.0
        assert series['rollout_dlq_records_total{reason="decode",stage="stream"}'] == 2.0
        assert series[f'rollout_consumer_lag{{group="{topics.group(STREAM_GROUP)}",partition="0",topic="{topics.turns}"}}'] == 3.0
        producer = KafkaProducer(**client_kwargs)
        letter = _dead_letter("stream", "decode", "code")
        producer.send(topics.dlq, key=letter.key, value=letter.value, headers=letter.record_headers())
        producer.close()
        deadline = time.monotonic() + 20
        while _scrape(url)['rollout_dlq_records_total{reason="decode",stage="stream"}'] != 3.0:
            assert time.monotonic() < deadline, "the exporter never counted the new dead letter"
            time.sleep(0.2)
        assert "rollout_run_max_staleness" not in series  # no batching declared on rollout.run yet
        check_run_batching(client_kwargs, topics, RunBatching(2, "step", 1, "test"))  # as a stage declares it
        deadline = time.monotonic() + 40  # the feed looks for the declaration again every WEIGHTS_RECHECK_S
        while _scrape(url).get("rollout_run_max_staleness") != 1.0:
            assert time.monotonic() < deadline, "the exporter never served the run's declared staleness bound"
            time.sleep(0.5)
    finally:
        _stop(proc)
    proc, url = _start_exporter(client_kwargs, topics)
    try:
        series = _scrape(url)  # served only once caught up: the totals, not zero
        assert series['rollout_dlq_records_total{reason="decode",stage="stream"}'] == 3.0
        assert series["rollout_batches_total"] == 2.0 and series['rollout_episodes_total{adapter="code"}'] == 3.0
        assert series["rollout_run_max_staleness"] == 1.0
    finally:
        _stop(proc)


def test_tail_sees_every_episode_and_batch_of_a_real_pipeline_run(kafka_bootstrap, tmp_path: Path):
    run, result = run_pipeline(kafka_bootstrap, tmp_path / "run", episodes=16)
    done = subprocess.run(
        [sys.executable, "-m", "rollout_bus.cli.tail", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix",
         run.topics.prefix, "--once", "--json", "--from-beginning",
         "--stream-group", "rollout-bus-stream", "--shards-group", "rollout-bus-shards"],  # scoped by the prefix
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    assert sum(row["episodes"] for row in snapshot["episodes"]) == 16
    assert snapshot["batches"] == len(list((run.out / "shards").glob("batch-*/manifest.json")))
    assert snapshot["dlq"]["counted"] == 0 and snapshot["skipped"] == 0
    assert {row["topic"] for row in snapshot["lag"]} == {run.topics.turns, run.topics.episodes}
    assert all(row["lag"] == 0 for row in snapshot["lag"] if row["topic"] == run.topics.turns), snapshot["lag"]
