"""train-sim against the real broker: it trains every written batch once per rank, in order; a SIGKILL
between checkpoints repeats exactly the batches after the checkpoint, with the same losses as an
undisturbed run; and ``demo --train`` runs it as a fourth stage and checks it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer

from rollout_bus.demo.run import written_batches
from rollout_bus.consumers.feed.training import read_trained, reconcile_training
from tests.integration.pipeline_harness import run_pipeline

pytestmark = pytest.mark.kafka

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def finished_run(kafka_bootstrap, tmp_path_factory):
    """One pipeline run (dp_size 2, 5 batches): its topic prefix, written seqs and shards directory."""
    out = tmp_path_factory.mktemp("train-run")
    run, _ = run_pipeline(kafka_bootstrap, out / "run", episodes=40)
    seqs = sorted(int(m["seq"]) for m in written_batches(out / "run" / "shards").values())
    assert len(seqs) >= 4
    return run.topics.prefix, seqs, out / "run" / "shards"


def command(bootstrap: str, prefix: str, checkpoint_dir: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "rollout_bus.cli.train_sim", "--bootstrap-servers", bootstrap, "--topic-prefix",
            prefix, "--ranks", "all", "--dp-size", "2", "--checkpoint-dir", str(checkpoint_dir),
            "--checkpoint-every", "2", "--timeout", "60", *more]


def run_to_end(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def seqs_by_rank(rows: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row in rows:
        out.setdefault(row["rank"], []).append(row["seq"])
    return out


@pytest.fixture(scope="module")
def undisturbed(kafka_bootstrap, finished_run, tmp_path_factory):
    prefix, _, _ = finished_run
    checkpoint_dir = tmp_path_factory.mktemp("undisturbed") / "train"
    done = run_to_end(command(kafka_bootstrap, prefix, checkpoint_dir))
    return checkpoint_dir, done


def test_train_sim_trains_every_written_batch_once_per_rank_in_order(finished_run, undisturbed):
    _, seqs, _ = finished_run
    checkpoint_dir, done = undisturbed
    rows = read_trained(checkpoint_dir)
    assert seqs_by_rank(rows) == {0: seqs, 1: seqs}
    assert reconcile_training(seqs, rows, [0, 1]).ok
    assert all(row["samples"] > 0 and row["loss"] == row["loss"] for row in rows)  # finite, non-empty
    assert done.stderr.count("trained seq=") == len(seqs)
    assert f"last_seq={seqs[-1]}" in done.stderr


def test_the_writer_and_the_trainer_report_their_flow_on_rollout_metrics(kafka_bootstrap, finished_run, undisturbed):
    prefix, seqs, shards = finished_run
    consumer = KafkaConsumer(f"{prefix}rollout.metrics", bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=3000)
    docs = [json.loads(r.value) for r in consumer]
    consumer.close()
    trainer = [d for d in docs if d["kind"] == "flow" and d["stage"] == "trainer"]
    assert trainer and trainer[-1]["final"] and trainer[-1]["source"] == "trainer"
    final = trainer[-1]["metrics"]
    assert final["rollout/flow/trainer/steps"] == len(seqs)
    assert 0 < final["rollout/flow/trainer/wait_s"] <= trainer[-1]["elapsed_s"]
    manifests = {int(m["seq"]): m for m in written_batches(shards).values()}
    batches = {d["batch"]: d["metrics"] for d in docs if d["kind"] == "batch"}
    assert sorted(batches) == seqs
    for seq, metrics in batches.items():  # nothing stale here: every token decided on was written
        assert metrics["rollout/flow/response_tokens"] == manifests[seq]["num_response_tokens"]
        assert 0 < metrics["rollout/flow/sample_age_s/p50"] <= metrics["rollout/flow/sample_age_s/p99"] < TIMEOUT_S
        assert metrics["rollout/flow/discarded_tokens/stale"] == 0.0


def test_a_sigkill_between_checkpoints_repeats_exactly_the_batches_after_it(kafka_bootstrap, finished_run,
                                                                           undisturbed, tmp_path):
    prefix, seqs, _ = finished_run
    checkpoint_dir = tmp_path / "train"
    # a pause after every step, so the kill lands after the third batch is trained and before the next
    # one: the checkpoint (every 2) holds two batches, the third is trained but not checkpointed
    cmd = command(kafka_bootstrap, prefix, checkpoint_dir, "--step-delay", "1.0")
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while f"trained seq={seqs[2]} " not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "train-sim never trained its third batch"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    first_log = log_path.read_text()
    assert f"trained seq={seqs[3]} " not in first_log
    assert seqs_by_rank(read_trained(checkpoint_dir)) == {0: seqs[:2], 1: seqs[:2]}  # the checkpointed history

    done = run_to_end(cmd)  # the same command again
    assert f"batches=2 next_seq={seqs[2]}" in done.stderr  # resumed from the checkpoint of two batches
    assert f"trained seq={seqs[2]} " in done.stderr  # trained again: it was after the checkpoint
    assert f"trained seq={seqs[1]} " not in done.stderr
    resumed, reference = read_trained(checkpoint_dir), read_trained(undisturbed[0])
    assert seqs_by_rank(resumed) == seqs_by_rank(reference) == {0: seqs, 1: seqs}
    # training is deterministic given the checkpoint: the same losses as the undisturbed run
    assert [(r["seq"], r["rank"]) for r in resumed] == [(r["seq"], r["rank"]) for r in reference]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference], rel=1e-6, abs=1e-9)


def test_demo_train_closes_the_loop_trains_every_batch_once_and_no_token_is_staler_than_the_bound(kafka_bootstrap,
                                                                                                   tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", "demo", "--train", "--episodes", "32",
                           "--groups-per-batch", "2", "--max-staleness", "1", "--interrupt-prob", "1.0",
                           "--bootstrap-servers", kafka_bootstrap, "--out", str(out), "--timeout", "120"],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every written batch trained once per rank, in order" in done.stderr
    assert "staleness: at most" in done.stderr and "(bound 1)" in done.stderr
    manifests = sorted(written_batches(out / "shards").values(), key=lambda m: int(m["seq"]))
    seqs = [int(m["seq"]) for m in manifests]
    assert seqs and seqs_by_rank(read_trained(out / "train")) == {0: seqs, 1: seqs}
    for manifest in manifests:  # the trainer's versions reached the generator, and the bound held
        k, versions = int(manifest["seq"]), [int(v) for v in manifest["extra"]["weight_versions"]]
        assert versions and min(versions) >= k - 1, (k, versions)
        assert manifest["has_rollout_token_versions"] and manifest["metrics"]["staleness/max"] <= 1
    assert max(int(v) for m in manifests for v in m["extra"]["weight_versions"]) >= 1
