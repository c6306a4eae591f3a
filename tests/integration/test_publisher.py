"""TurnPublisher and `generate` against the real broker: what goes in comes back, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from rollout_bus.sim.generator import iter_turns
from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.wire.codec import decode_samples
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import BrokerError, ContractError
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.limits import pending_bytes_limit, producer_config
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.model.sample import Sample, Status
from rollout_bus.wire.rollout_key import rollout_key_of

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]


def read_all(client_kwargs: dict, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    """Every record of ``topic`` from the beginning, once ``expected`` have arrived (or the deadline passed)."""
    consumer = KafkaConsumer(**client_kwargs, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        got: list = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                got.extend(batch)
            if len(got) >= expected:
                deadline = min(deadline, time.monotonic() + 1.0)  # linger briefly: nothing more should come
        return got
    finally:
        consumer.close()


def small_settings(**overrides) -> GenerateSettings:
    return GenerateSettings(**{**dict(episodes=4, vocab_size=2048, max_response_len=12, min_response_len=4),
                               **overrides})


def test_published_turns_come_back_with_the_same_key_value_and_headers(client_kwargs, topics):
    turns = list(iter_turns(small_settings(adapters="math")))
    before_ms = time.time_ns() // 1_000_000
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns) as publisher:
        futures = [publisher.publish_turn(s, **args) for s, args in turns]
        publisher.flush()
    assert all(f.is_done and f.succeeded() for f in futures)
    records = read_all(client_kwargs, topics.turns, len(turns))
    assert len(records) == len(turns)
    by_key: dict = {}
    for record in records:
        by_key.setdefault(record.key, []).append(record)
    for sample, args in turns:
        key = rollout_key_of(sample).encode()
        record = by_key[key].pop(0)  # one partition per key: turns of an episode stay in order
        (decoded,), _ = decode_samples(record.value, TURN_FIELDS)
        assert decoded == sample
        headers = TurnHeaders.from_kafka(record.headers)
        assert (headers.turn, headers.attempt, headers.final, headers.group_size) == (
            args["turn"], args["attempt"], args["final"], args["group_size"])
        assert before_ms <= headers.sent_at_ms <= time.time_ns() // 1_000_000
    assert len({r.partition for r in records}) > 1 or len(by_key) == 1


def test_an_invalid_sample_is_refused_and_never_sent(client_kwargs, topics):
    good = Sample(group_index=0, index=0, rollout_id=0, tokens=[1, 2, 3], response_length=1, loss_mask=[1],
                  status=Status.COMPLETED)
    bad = Sample(group_index=0, index=1, rollout_id=1, tokens=[1, 2, 3], response_length=2, loss_mask=[1],
                 status=Status.COMPLETED)
    anonymous = Sample(tokens=[1, 2], response_length=1, status=Status.COMPLETED)
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns) as publisher:
        with pytest.raises(ContractError, match=r"turn=3 .*\[null,null,\"rollout\",0,1\].*loss_mask"):
            publisher.publish_turn(bad, turn=3, final=False, group_size=2)
        with pytest.raises(ContractError, match="position"):
            publisher.publish_turn(anonymous, turn=0, final=True, group_size=1)
        publisher.publish_turn(good, turn=0, final=True, group_size=2)
    records = read_all(client_kwargs, topics.turns, 1, timeout_s=10)
    assert [r.key for r in records] == [b'[null,null,"rollout",0,0]']


def test_extra_kafka_config_passes_through_to_the_producer(client_kwargs, topics):
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns, client_id="custom-id",
                       compression_type="gzip", linger_ms=0) as publisher:
        assert publisher._producer.config["client_id"] == "custom-id"
        assert publisher._producer.config["enable_idempotence"] is True
        assert publisher._producer.config["acks"] == -1


def end_of_run_markers(records) -> dict[int, list[EndOfRun]]:
    """The end-of-run records by partition (each checked to be its partition's last record)."""
    by_partition: dict[int, list] = {}
    for record in records:
        by_partition.setdefault(record.partition, []).append(record)
    markers = {}
    for partition, found in by_partition.items():
        ends = [r for r in found if control_kind(r.headers) == "end-of-run"]
        assert all(r.key == END_OF_RUN_KEY for r in ends)
        if ends:
            assert found[-1] is ends[-1], f"records after the end of run on partition {partition}"
        markers[partition] = [EndOfRun.from_value(r.value) for r in ends]
    return markers


def test_generate_command_publishes_every_turn_and_accounts_for_every_episode(client_kwargs, topics, tmp_path):
    summary_path = tmp_path / "summary.json"
    prefix = topics.turns[: -len("rollout.turns")]
    done = subprocess.run(
        [sys.executable, "-m", "rollout_bus.cli.generate", "--bootstrap-servers", client_kwargs["bootstrap_servers"],
         "--topic-prefix", prefix, "--episodes", "8", "--summary-out", str(summary_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(summary_path.read_text())
    everything = read_all(client_kwargs, topics.turns, summary["turns_sent"] + topics.turns_partitions)
    markers = end_of_run_markers(everything)
    run = summary["run_id"]
    assert len(run) == 32 and run in done.stderr and summary["end_of_run_partitions"] == topics.turns_partitions
    assert markers == {p: [EndOfRun(run)] for p in range(topics.turns_partitions)}
    records = [r for r in everything if control_kind(r.headers) is None]
    assert len(records) == summary["turns_sent"] >= 8
    finals = [(r.key.decode(), TurnHeaders.from_kafka(r.headers).attempt) for r in records
              if TurnHeaders.from_kafka(r.headers).final]
    assert sorted(finals) == sorted(tuple(e) for e in summary["episodes"])
    assert len(finals) == summary["episodes_finished"] == 8
    assert summary["bytes_sent"] == sum(len(r.key) + len(r.value) for r in records)
    expected = [s for s, _ in iter_turns(GenerateSettings(episodes=8))]
    decoded = [decode_samples(r.value, TURN_FIELDS)[0][0] for r in records]
    assert sorted(int(np.sum(s.response_length)) for s in decoded) == sorted(s.response_length for s in expected)


def test_a_delivery_failure_surfaces_on_flush(client_kwargs, topics):
    small = f"{topics.turns}.small"
    ensure_topics(client_kwargs, topics, extra={small: 1}, max_record_bytes=1 << 20)  # created: a 2 MiB limit
    publisher = TurnPublisher(client_kwargs["bootstrap_servers"], topic=small, compression_type="gzip")
    too_big = np.random.default_rng(0).bytes(3_000_000)  # incompressible, over that topic's limit
    future = publisher.send_raw(b"k", too_big, [])
    with pytest.raises(BrokerError, match="failed delivery"):
        publisher.flush(timeout=60)
    assert future.failed()
    publisher.close(timeout=5)  # the failure was reported once; closing is clean


def test_a_turn_over_max_record_bytes_is_refused_before_sending_with_its_key_turn_size_and_limit(client_kwargs,
                                                                                                   topics):
    big = Sample(group_index=3, index=1, rollout_id=1, tokens=list(range(400_000)), response_length=2,
                 loss_mask=[1, 1], status=Status.COMPLETED)
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns, max_record_bytes=1 << 20) as publisher:
        with pytest.raises(ContractError, match=r'turn=2 of rollout key=\[null,null,"rollout",3,1\]: its encoded '
                                                r"value is \d+ bytes, over max_record_bytes=1048576"):
            publisher.publish_turn(big, turn=2, final=True, group_size=2)
        assert publisher.records_sent == 0
    assert read_all(client_kwargs, topics.turns, 0, timeout_s=3) == []


def test_the_producer_is_sized_by_max_record_bytes_patient_for_outages_and_explicit_settings_win(client_kwargs,
                                                                                                   topics):
    sized = producer_config(8 << 20)["max_request_size"]
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns, max_record_bytes=8 << 20,
                       delivery_timeout_s=600) as publisher:
        config = publisher._producer.config
        assert config["max_request_size"] == sized and config["compression_type"] == "lz4"
        assert config["delivery_timeout_ms"] == config["max_block_ms"] == 600_000
        assert config["allow_auto_create_topics"] is False
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns, max_record_bytes=8 << 20,
                       max_request_size=3 << 20, delivery_timeout_ms=90_000) as publisher:
        assert publisher._producer.config["max_request_size"] == 3 << 20
        assert publisher._producer.config["delivery_timeout_ms"] == 90_000
    # limits.producer_config passes straight in; kafka-python 3 has no buffer pool, the publisher bounds what waits
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns, max_record_bytes=8 << 20,
                       **producer_config(8 << 20)) as publisher:
        assert publisher._pending_limit == pending_bytes_limit(8 << 20)
        publisher.send_raw(b"k", b"v", [])


def test_end_of_run_goes_to_every_partition_after_everything_sent_before(client_kwargs, topics):
    turns = list(iter_turns(small_settings()))
    with TurnPublisher(client_kwargs["bootstrap_servers"], topic=topics.turns) as publisher:
        for sample, args in turns:
            publisher.publish_turn(sample, **args)
        assert publisher.publish_end_of_run("r1") == topics.turns_partitions
        assert publisher.records_sent == len(turns)
    records = read_all(client_kwargs, topics.turns, len(turns) + topics.turns_partitions)
    assert end_of_run_markers(records) == {p: [EndOfRun("r1")] for p in range(topics.turns_partitions)}
    assert len(records) == len(turns) + topics.turns_partitions


def test_end_run_command_closes_a_run_by_hand_and_refuses_a_topic_that_does_not_exist(client_kwargs, topics):
    prefix = topics.turns[: -len("rollout.turns")]
    base = [sys.executable, "-m", "rollout_bus.cli.end_run", "--bootstrap-servers", client_kwargs["bootstrap_servers"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*base, "--topic-prefix", prefix, "--run-id", "by-hand"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"run by-hand closed on {topics.turns_partitions} partitions" in done.stderr
    records = read_all(client_kwargs, topics.turns, topics.turns_partitions)
    assert end_of_run_markers(records) == {p: [EndOfRun("by-hand")] for p in range(topics.turns_partitions)}
    missing = subprocess.run([*base, "--topic-prefix", "no-such-prefix-x.", "--run-id", "r"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_a_record_refused_for_its_timestamp_is_reported_as_a_clock_to_check(kafka_bootstrap, tmp_path):
    """A generator whose clock runs 2 h ahead: the broker's real refusal (INVALID_TIMESTAMP) reaches the person as
    one line that says which clock to check, through the publisher's own failure path."""
    from kafka import KafkaProducer

    topic = f"clock-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        future = producer.send(topic, b"v", timestamp_ms=int((time.time() + 7200) * 1000))
        producer.flush()
        refused = future.exception
    finally:
        producer.close()
    assert type(refused).__name__ == "InvalidTimestampError", refused
    publisher = TurnPublisher(kafka_bootstrap, topic=topic)
    try:
        publisher._on_failure(refused)  # what the producer's I/O thread calls for a refused record
        with pytest.raises(BrokerError) as raised:
            publisher.flush()
    finally:
        publisher._producer.close()
    message = str(raised.value)
    assert "1 record(s)" in message and "out of range" in message and "check this host's clock" in message
    assert "\n" not in message
