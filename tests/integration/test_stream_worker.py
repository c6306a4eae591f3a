"""The stream stage end to end on the real broker: workers run as ``python -m rollout_bus.cli.stream``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

import pytest
from kafka import KafkaConsumer, KafkaProducer

from rollout_bus.sim.generator import iter_turns
from tests.integration.groups import stable_group
from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.config import GenerateSettings
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.episode_stats import adapter_scope
from rollout_bus.model.metrics import compute_metrics_from_samples
from rollout_bus.wire.episode_record import decode_episode
from rollout_bus.wire.metrics_records import fold_window_records
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.wire.rollout_key import rollout_key_of
from rollout_bus.model.turns import merge_samples
from rollout_bus.streams.episode_state import share_final_reward

pytestmark = pytest.mark.kafka

WINDOW_S = 2.0


def _merged_windows(records) -> dict:
    """Each window's statistics per adapter, merged over source partitions: ``{((start, end), adapter): stats}``."""
    folds = fold_window_records([r.value for r in records]).values()
    return {((f.start_ms, f.end_ms), f.adapter): f.stats for f in folds if f.stats is not None}


def _generated(episodes: int, seed: int, **knobs):
    settings = GenerateSettings(episodes=episodes, seed=seed, adapters="math,code", vocab_size=4096,
                                max_response_len=32, **knobs)
    return list(iter_turns(settings))


def _publish(kafka_bootstrap, topics, turns) -> None:
    publisher = TurnPublisher(kafka_bootstrap, topic=topics.turns)
    for sample, args in turns:
        publisher.publish_turn(sample, **args)
    publisher.close()


def _expected_episodes(turns) -> dict[tuple[bytes, int], list]:
    """(key, attempt) of every finished episode -> the segments the stage must emit."""
    by_attempt = defaultdict(list)
    done = {}
    for sample, args in turns:
        key = rollout_key_of(sample).encode()
        by_attempt[(key, args["attempt"])].append(sample)
        if args["final"]:
            samples = by_attempt[(key, args["attempt"])]
            done[(key, args["attempt"])] = share_final_reward(merge_samples(samples), samples[-1])
    return done


class Worker:
    """One ``rollout-bus stream`` subprocess with its own log file."""

    def __init__(self, kafka_bootstrap, topics, app_id, tmp_path, name="worker"):
        self.log_path = tmp_path / f"{name}-{uuid.uuid4().hex[:4]}.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "rollout_bus.cli.stream", "--bootstrap-servers", kafka_bootstrap,
               "--topic-prefix", topics.prefix, "--app-id", app_id, "--window-seconds", str(WINDOW_S),
               "--grace-seconds", "0.5", "--stats-interval", "2", "--data-dir", str(tmp_path / f"data-{name}")]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self._log.close()
        return code

    def counts(self) -> dict[str, int]:
        found = re.findall(r"stream worker stopped status=\S+ counts (.*)", self.log())
        return {k: int(v) for k, v in (pair.split("=") for pair in found[-1].split())} if found else {}


class Reader:
    """Reads a topic from the beginning, accumulating records."""

    def __init__(self, kafka_bootstrap, topic):
        self.consumer = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                                      enable_auto_commit=False, group_id=None)
        self.records = []

    def until(self, done, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while not done(self.records) and time.monotonic() < deadline:
            for batch in self.consumer.poll(timeout_ms=300).values():
                self.records.extend(batch)
        return self.records

    def close(self):
        self.consumer.close()


def _keys(records) -> set[tuple[bytes, int]]:
    return {(r.key, decode_episode(r.value)[1].attempt) for r in records}


@pytest.fixture
def app_id():
    return f"stream-test-{uuid.uuid4().hex[:8]}"


def test_episodes_equal_the_merge_of_their_turns_and_windows_equal_the_batch_metrics(
        kafka_bootstrap, topics, app_id, tmp_path):
    turns = _generated(16, seed=3, compaction_prob=0.5)
    expected = _expected_episodes(turns)
    _publish(kafka_bootstrap, topics, turns)
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path)
    episodes, metrics = Reader(kafka_bootstrap, topics.episodes), Reader(kafka_bootstrap, topics.metrics)
    try:
        got = episodes.until(lambda rs: len(rs) >= len(expected))
        assert _keys(got) == set(expected), worker.log()
        by_window = defaultdict(list)
        for record in got:
            segments, info = decode_episode(record.value)
            assert segments == expected[(record.key, info.attempt)]
            start = int(info.event_time_ms // (WINDOW_S * 1000) * WINDOW_S * 1000)
            by_window[((start, start + int(WINDOW_S * 1000)), adapter_scope(segments[0]))].extend(segments)
        assert any(len(decode_episode(r.value)[0]) > 1 for r in got), "no compaction siblings in the workload"
        total = lambda rs: sum(s.episodes for s in _merged_windows(rs).values())  # noqa
        merged = _merged_windows(metrics.until(lambda rs: total(rs) >= len(expected)))
        assert set(merged) == set(by_window)
        for window, samples in by_window.items():
            batch = compute_metrics_from_samples(samples)
            assert merged[window].metrics() == {k: batch[k] for k in merged[window].metrics()}
    finally:
        episodes.close()
        metrics.close()
        assert worker.stop() == 0
    counts = worker.counts()
    assert counts["turns_received"] == len(turns) and counts["episodes_emitted"] == len(expected)
    assert not any(k.startswith("dlq.") for k in counts), counts


def test_bad_records_go_to_the_dlq_and_later_episodes_still_arrive(kafka_bootstrap, topics, app_id, tmp_path):
    first, later = _generated(4, seed=5), _generated(4, seed=6)
    later = [(s, a) for s, a in later]
    for sample, _ in later:  # other rollout ids, so the later episodes are new ones
        sample.rollout_id += 100
        sample.index += 100
    _publish(kafka_bootstrap, topics, first)
    final_sample, final_args = next((s, a) for s, a in reversed(first) if a["final"])
    key = rollout_key_of(final_sample).encode()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    late_headers = TurnHeaders(final_args["turn"] + 1, final_args["attempt"], True, 4, 1).to_kafka()
    producer.send(topics.turns, key=b"garbage", value=b"\x00not a payload", headers=late_headers)
    producer.send(topics.turns, key=key, value=_encode(final_sample), headers=late_headers)
    producer.flush()
    producer.close()
    _publish(kafka_bootstrap, topics, later)
    expected = set(_expected_episodes(first)) | set(_expected_episodes(later))
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path)
    episodes, dlq = Reader(kafka_bootstrap, topics.episodes), Reader(kafka_bootstrap, topics.dlq)
    try:
        assert _keys(episodes.until(lambda rs: len(rs) >= len(expected))) == expected, worker.log()
        letters = [DeadLetter.from_record(r.key, r.value, r.headers) for r in dlq.until(lambda rs: len(rs) >= 2)]
        assert sorted(d.kind for d in letters) == ["decode", "finished"]
        assert all(d.stage == "stream" and d.source.startswith(topics.turns + ":") for d in letters)
        assert next(d for d in letters if d.kind == "decode").value == b"\x00not a payload"
    finally:
        episodes.close()
        dlq.close()
        assert worker.stop() == 0
    assert worker.counts()["dlq.finished"] == 1


def _encode(sample):
    from rollout_bus.wire.codec import encode_samples
    from rollout_bus.wire.episode_record import TURN_FIELDS

    return encode_samples([sample], TURN_FIELDS)


def test_a_worker_killed_mid_run_and_restarted_loses_no_episode(kafka_bootstrap, topics, app_id, tmp_path):
    turns = _generated(48, seed=7)
    expected = _expected_episodes(turns)
    # Half the turns before the kill, half after: the restarted worker must finish episodes the first one
    # began (their turns are in its state changelog), and it is surely running (signal handlers in place)
    # when the last episode arrives. With every turn published at once, the first worker could emit every
    # episode before its kill, and the SIGTERM below would reach a worker still importing (exit -15).
    _publish(kafka_bootstrap, topics, turns[:len(turns) // 2])
    episodes = Reader(kafka_bootstrap, topics.episodes)
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path, "first")
    try:
        episodes.until(lambda rs: len(rs) >= 3)
        assert worker.stop(signal.SIGKILL) == -signal.SIGKILL
        again = Worker(kafka_bootstrap, topics, app_id, tmp_path, "second")
        _publish(kafka_bootstrap, topics, turns[len(turns) // 2:])
        got = episodes.until(lambda rs: _keys(rs) >= set(expected), timeout_s=90)
        assert _keys(got) == set(expected), again.log()
        for record in got:  # a re-emitted episode is the same episode
            segments, info = decode_episode(record.value)
            assert segments == expected[(record.key, info.attempt)]
        assert again.stop() == 0
        assert not any(k.startswith("dlq.") for k in again.counts()), again.counts()
    finally:
        episodes.close()


def _wait_for_stable_group(kafka_bootstrap, group, members, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = stable_group({"bootstrap_servers": kafka_bootstrap}, group)
        if state is not None and len(state["members"]) == members:
            time.sleep(1.0)  # table recovery of the (empty) changelog after the assignment
            return
        time.sleep(0.5)
    raise AssertionError(f"group {group} did not settle with {members} members in {timeout_s}s")


def test_two_workers_share_the_partitions_of_the_turns_topic(kafka_bootstrap, topics, app_id, tmp_path):
    one = Worker(kafka_bootstrap, topics, app_id, tmp_path, "one")
    two = Worker(kafka_bootstrap, topics, app_id, tmp_path, "two")
    _wait_for_stable_group(kafka_bootstrap, topics.group(app_id), members=2)  # both hold partitions first
    turns = _generated(24, seed=9)
    expected = _expected_episodes(turns)
    _publish(kafka_bootstrap, topics, turns)
    episodes = Reader(kafka_bootstrap, topics.episodes)
    try:
        got = _keys(episodes.until(lambda rs: _keys(rs) >= set(expected), timeout_s=90))
        assert got == set(expected), (len(got), len(expected), one.log()[-3000:], two.log()[-3000:])
    finally:
        episodes.close()
        assert one.stop() == 0 and two.stop() == 0
    emitted = [one.counts().get("episodes_emitted", 0), two.counts().get("episodes_emitted", 0)]
    assert all(n > 0 for n in emitted) and sum(emitted) >= len(expected), (emitted, one.log(), two.log())
