"""The shard writer against a real broker, run as ``python -m rollout_bus.cli.shards`` subprocesses.

Every run ends on the end-of-run markers the stream stage would forward (``end_of_run``), with
``--exit-on-end-of-run``: batch boundaries never depend on a clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from rollout_bus.consumers.shard_writer.out_dir import scan_out_dir
from rollout_bus.consumers.shard_writer.writer_lock import LOCK_NAME
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.metrics import compute_metrics_from_samples
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.episode_record import EpisodeInfo, encode_episode
from rollout_bus.wire.headers import control_kind
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.wire.rollout_key import rollout_key_string
from rollout_bus.model.shards import load_shard

pytestmark = pytest.mark.kafka

ADAPTERS = [None, AdapterRef("math", 1), AdapterRef("code", 2)]
GROUP_SIZE = 3
REPO = Path(__file__).resolve().parents[2]


def make_segment(adapter, group_index: int, rid: int, part: int, *, with_mask: bool = True) -> Sample:
    """A turn-merged segment: prompt + response, a forced (loss 0) token, ragged supports."""
    rng = np.random.default_rng(1000 * group_index + 10 * rid + part)
    prompt, length = int(rng.integers(2, 6)), int(rng.integers(2, 7))
    tokens = rng.integers(0, 5000, prompt + length)
    loss = np.ones(length, np.int64)
    loss[0] = 0
    rows = [[int(t)] if i == 0 else sorted({int(t), *rng.integers(0, 5000, int(rng.integers(1, 4))).tolist()})
            for i, t in enumerate(tokens[prompt:])]
    return Sample(group_index=group_index, index=rid, rollout_id=rid, tokens=tokens, response_length=length,
                  loss_mask=loss, rollout_log_probs=np.where(loss == 1, -0.25, 0.0),
                  reward=float((rid + group_index) % 2),
                  rollout_sampling_mask=RolloutSamplingMask.from_mask_list(rows) if with_mask else None,
                  status=Status.TRUNCATED if rid % 4 == 3 else Status.COMPLETED, adapter=adapter)


def make_episode(group_index: int, rid: int, *, attempt: int = 0, maskless: bool = False):
    """(key, value, headers) of one episode; every third one has a compaction sibling."""
    adapter = ADAPTERS[group_index % len(ADAPTERS)]
    parts = 2 if rid % 3 == 1 else 1
    segments = [make_segment(adapter, group_index, rid, p, with_mask=not (maskless and p == 0)) for p in range(parts)]
    info = EpisodeInfo(attempt=attempt, turns=parts + 1, group_size=GROUP_SIZE, final_sent_at_ms=1, event_time_ms=1)
    key = rollout_key_string((adapter, "rollout", group_index, rid))
    return key.encode(), encode_episode(segments, info), info.headers()


def end_of_run(topics, run: str = "run-1", turns_partitions: int = 2, only=None):
    """The end-of-run markers the stream stage forwards: every turns partition's, on every episodes partition
    (``only``: just these (turns partition, episodes partition) pairs)."""
    return [(END_OF_RUN_KEY, EndOfRun(run).forwarded(t, turns_partitions).value(), EndOfRun(run).headers(), p)
            for t in range(turns_partitions) for p in range(topics.episodes_partitions)
            if only is None or (t, p) in only]


def publish(client_kwargs, topic: str, records) -> None:
    """(key, value, headers) records, or (key, value, headers, partition)."""
    producer = KafkaProducer(acks="all", **client_kwargs)
    for key, value, headers, *partition in records:
        producer.send(topic, key=key, value=value, headers=headers, partition=partition[0] if partition else None)
    producer.flush()
    producer.close()


def read_topic(client_kwargs, topic: str) -> list:
    consumer = KafkaConsumer(enable_auto_commit=False, **client_kwargs)
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    ends = consumer.end_offsets(partitions)
    out = []
    deadline = time.monotonic() + 20
    while any(consumer.position(tp) < end for tp, end in ends.items()) and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            out.extend(records)
    consumer.close()
    return out


def writer_command(kafka_bootstrap, topics, out: Path, group_id: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollout_bus.cli.shards", "--bootstrap-servers", kafka_bootstrap,
            "--topic-prefix", topics.prefix, "--out", str(out), "--dp-size", "2", "--groups-per-batch", "2",
            "--group-id", group_id, "--exit-on-end-of-run", *extra]


def run_writer(kafka_bootstrap, topics, out: Path, group_id: str | None = None, *extra: str):
    done = subprocess.run(writer_command(kafka_bootstrap, topics, out, group_id or uuid.uuid4().hex, *extra),
                          cwd=REPO, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_NAME}  # the lock names its holder


def manifests(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.glob("batch-*/manifest.json"))]


def shard_samples(root: Path) -> list[tuple[dict, list]]:
    """Per batch: its manifest and its samples in batch order, read back with load_shard."""
    out = []
    for manifest in manifests(root):
        rows = []
        for entry in manifest["shards"]:
            rows.extend(load_shard(root / manifest["batch"] / entry["path"]).samples())
        out.append((manifest, sorted(rows, key=lambda s: s.position)))
    return out


def rebuilt(row) -> Sample:
    """The Sample a shard row stands for, as far as the batch metrics see it."""
    slot = {a.slot: a for a in ADAPTERS if a is not None}
    return Sample(group_index=row.group_index, index=row.sample_index, rollout_id=row.rollout_id,
                  tokens=row.tokens.numpy(), response_length=row.response_length, loss_mask=row.loss_mask.numpy(),
                  reward=row.raw_reward, status=Status.TRUNCATED if row.truncated else Status.COMPLETED,
                  adapter=slot.get(row.adapter_slot))


def standard_records(topics, n_groups: int = 7):
    """n_groups full groups, a retry (higher attempt first), a duplicate and an undecodable record, then the
    end-of-run markers."""
    records = [make_episode(g, r) for g in range(n_groups) for r in range(GROUP_SIZE)]
    retried = make_episode(2, 1, attempt=1)
    records.insert(5, retried)                     # the retry's record comes before the aborted attempt's
    records.append(make_episode(0, 0))             # duplicate of an episode
    records.append((b"broken", b"\x00not an episode", []))
    return records + end_of_run(topics)


def test_every_episode_lands_once_with_its_masks_and_a_replay_is_byte_identical(kafka_bootstrap, client_kwargs,
                                                                                topics, tmp_path):
    publish(client_kwargs, topics.episodes, standard_records(topics))
    first, second = tmp_path / "first", tmp_path / "second"
    run_writer(kafka_bootstrap, topics, first)

    batches = shard_samples(first)
    assert [m["seq"] for m, _ in batches] == [0, 1, 2, 3]
    assert [m["extra"]["partial"] for m, _ in batches] == [False, False, False, True]
    keys = [(e["key"], e["attempt"]) for m, _ in batches for e in m["extra"]["episodes"]]
    expected_keys = sorted(make_episode(g, r)[0].decode() for g in range(7) for r in range(GROUP_SIZE))
    assert sorted(k for k, _ in keys) == expected_keys
    assert dict(keys)[make_episode(2, 1)[0].decode()] == 1
    seen = [(row.adapter_slot, row.group_index, row.rollout_id) for _, rows in batches for row in rows]
    want = [(-1 if ADAPTERS[g % 3] is None else ADAPTERS[g % 3].slot, g, r)
            for g in range(7) for r in range(GROUP_SIZE) for _ in range(2 if r % 3 == 1 else 1)]
    assert sorted(seen) == sorted(want)
    for manifest, rows in batches:
        for row in rows:
            assert len(row.rollout_sampling_mask) == row.response_length == int(row.loss_mask.numel())
            originals = [make_segment(ADAPTERS[row.group_index % 3], row.group_index, row.rollout_id, p)
                         for p in (0, 1)]
            [original] = [o for o in originals if o.tokens.tolist() == row.tokens.tolist()]
            assert row.rollout_sampling_mask == original.rollout_sampling_mask
            assert row.loss_mask.tolist() == original.loss_mask.tolist()
        assert manifest["metrics"] == pytest.approx(compute_metrics_from_samples([rebuilt(r) for r in rows]))

    dead = [DeadLetter.from_record(r.key, r.value, r.headers) for r in read_topic(client_kwargs, topics.dlq)]
    assert [(d.key, d.stage, d.kind) for d in dead] == [(b"broken", "shards", "decode")]
    shards = read_topic(client_kwargs, topics.shards)
    announced = [json.loads(r.value) for r in shards if control_kind(r.headers) is None]  # batches, not controls
    assert sorted(a["seq"] for a in announced) == [0, 1, 2, 3]
    batch_records = [json.loads(r.value) for r in read_topic(client_kwargs, topics.metrics)]
    assert sorted(b["batch"] for b in batch_records if b["kind"] == "batch") == [0, 1, 2, 3]

    run_writer(kafka_bootstrap, topics, second)
    assert tree_hashes(second) == tree_hashes(first)
    assert len(tree_hashes(first)) == 4 * 3


def test_batch_with_a_sample_lacking_its_mask_goes_to_the_dlq_and_the_next_batch_is_written(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    records = [make_episode(g, r, maskless=(g, r) == (1, 2)) for g in range(4) for r in range(GROUP_SIZE)]
    publish(client_kwargs, topics.episodes, records + end_of_run(topics))
    run_writer(kafka_bootstrap, topics, tmp_path)

    assert [m["seq"] for m in manifests(tmp_path)] == [1]
    assert not (tmp_path / "batch-00000000").exists()
    dead = [DeadLetter.from_record(r.key, r.value, r.headers) for r in read_topic(client_kwargs, topics.dlq)]
    batch0 = sorted(k.decode() for k, _, _ in records[:2 * GROUP_SIZE])
    assert sorted(d.key.decode() for d in dead) == batch0
    assert {d.kind for d in dead} == {"mask-check"}
    for d in dead:
        assert "position=" in d.reason and "sample_index=2" in d.reason and "status=completed" in d.reason
        assert d.source.startswith(f"{topics.episodes}:")
    assert {(d.key, d.value) for d in dead} <= {(k, v) for k, v, _ in records}


def test_writer_killed_mid_run_restarts_to_byte_identical_shards(kafka_bootstrap, client_kwargs, topics,
                                                                 tmp_path):
    publish(client_kwargs, topics.episodes, standard_records(topics, n_groups=9))
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run_writer(kafka_bootstrap, topics, reference)

    group_id = uuid.uuid4().hex
    proc = subprocess.Popen(writer_command(kafka_bootstrap, topics, killed, group_id), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (killed / "batch-00000000" / "manifest.json").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "the writer exited before its first batch"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    run_writer(kafka_bootstrap, topics, killed, group_id)

    assert tree_hashes(killed) == tree_hashes(reference)
    announced = [json.loads(r.value) for r in read_topic(client_kwargs, topics.shards)
                 if control_kind(r.headers) is None]
    assert all(a["dir"] == f"batch-{a['seq']:08d}" and a["manifest_path"] == f"{a['dir']}/manifest.json"
               for a in announced)  # relative to the output root, which is named apart
    # every batch on disk is announced (by the reference writer, or by this one where it wrote another one)
    assert _on_disk(killed) <= {(a["dir"], a["manifest_sha256"]) for a in announced}
    assert len(_on_disk(killed)) == 5


def _on_disk(out: Path) -> set[tuple[str, str]]:
    """(batch directory name, manifest sha256) of every complete batch under ``out``."""
    return {(batch.directory.name, batch.manifest_sha256) for batch in scan_out_dir(out)}


def test_restart_over_leftovers_rewrites_the_incomplete_batch_and_announces_the_unannounced(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics.episodes, standard_records(topics))
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    run_writer(kafka_bootstrap, topics, reference)
    shutil.copytree(reference, crashed)             # batches complete on disk, never announced for this dir
    (crashed / "batch-00000001" / "manifest.json").unlink()  # killed before batch 1's manifest
    (crashed / "batch-00000002" / ".dp-000.safetensors.123-beef.tmp").write_bytes(b"half a shard")

    run_writer(kafka_bootstrap, topics, crashed)
    assert tree_hashes(crashed) == tree_hashes(reference)
    shards = read_topic(client_kwargs, topics.shards)
    announced = [json.loads(r.value) for r in shards if control_kind(r.headers) is None]  # batches, not controls
    # batches 0, 2 and 3 are the reference's, byte for byte, and announced; batch 1 is announced again as
    # written here (a batch's identity is its name and manifest, not the directory it was read from)
    assert [a["seq"] for a in announced if a["out_root"] == str(crashed.resolve())] == [1]
    assert _on_disk(crashed) <= {(a["dir"], a["manifest_sha256"]) for a in announced}

    run_writer(kafka_bootstrap, topics, reference)  # everything already written and announced: nothing new
    again = [json.loads(r.value) for r in read_topic(client_kwargs, topics.shards) if control_kind(r.headers) is None]
    assert len(again) == len(announced)
    assert tree_hashes(reference) == tree_hashes(crashed)


def test_arrival_mode_stops_at_max_batches_and_a_restart_writes_the_rest_once(kafka_bootstrap, client_kwargs,
                                                                              topics, tmp_path):
    publish(client_kwargs, topics.episodes,
            [make_episode(g, r) for g in range(4) for r in range(GROUP_SIZE)] + end_of_run(topics))
    group_id = uuid.uuid4().hex
    run_writer(kafka_bootstrap, topics, tmp_path, group_id, "--batching", "arrival", "--max-batches", "1")
    assert [m["seq"] for m in manifests(tmp_path)] == [0]
    run_writer(kafka_bootstrap, topics, tmp_path, group_id, "--batching", "arrival")

    written = manifests(tmp_path)
    assert [m["seq"] for m in written] == [0, 1]
    assert all(not m["extra"]["partial"] and len(m["extra"]["groups"]) == 2 for m in written)
    keys = sorted(e["key"] for m in written for e in m["extra"]["episodes"])
    assert keys == sorted(make_episode(g, r)[0].decode() for g in range(4) for r in range(GROUP_SIZE))


def test_a_second_writer_on_the_same_output_directory_is_refused_naming_the_first(kafka_bootstrap, topics, tmp_path):
    out = tmp_path / "shards"
    first = subprocess.Popen(writer_command(kafka_bootstrap, topics, out, "first-writer"), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # no end of run: it waits
    try:
        deadline = time.monotonic() + 60
        while not (out / ".writer.lock").exists() or not (out / ".writer.lock").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first writer never took its lock"
            time.sleep(0.05)
        second = subprocess.run(writer_command(kafka_bootstrap, topics, out, "second-writer"), cwd=REPO,
                                capture_output=True, text=True, timeout=90)
        assert second.returncode == 2, second.stdout + second.stderr
        said = " ".join((second.stdout + second.stderr).split())
        assert "another shard writer" in said and f"group={topics.group('first-writer')}" in said and f"pid={first.pid}" in said
        assert first.poll() is None  # the first one writes on
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
