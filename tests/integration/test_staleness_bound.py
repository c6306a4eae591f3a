"""The staleness bound against the real broker: generator processes and a slow trainer simulated here.

The trainer publishes version v+1 on rollout.weights only once it has read every group of batch v
(step batching: batch k = group indices [k*G, (k+1)*G)) from rollout.turns. With ``--max-staleness K``
a generator starts a group of batch k only under version >= k - K: so it waits for the trainer, no
turn of batch k carries an older version, and nothing past the bound is generated while it waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition

from rollout_bus.wire.codec import decode_samples
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.consumers.feed.weights import WeightPublisher
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.topics import Topics

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[2]

G, K, N, EPISODES = 2, 1, 4, 32  # groups per batch, max staleness, episodes per group, episodes per generator
GROUPS = EPISODES // N
BATCHES = GROUPS // G
WAITING = "waiting for weights version"
DEADLINE_S = 50.0


@pytest.fixture
def fresh(client_kwargs) -> Topics:
    topics = Topics(prefix=f"s{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, topics)
    return topics


class Generator:
    """One `rollout-bus generate` process under the bound; its log and summary in ``tmp``."""

    def __init__(self, bootstrap: str, topics: Topics, tmp: Path, name: str, *extra: str) -> None:
        self.log_path, self.summary_path = tmp / f"{name}.log", tmp / f"{name}.json"
        prefix = topics.turns[: -len("rollout.turns")]
        self.argv = [sys.executable, "-m", "rollout_bus.cli.generate", "--bootstrap-servers", bootstrap,
                     "--topic-prefix", prefix, "--episodes", str(EPISODES), "--n-samples-per-prompt", str(N),
                     "--max-staleness", str(K), "--groups-per-batch", str(G), "--vocab-size", "2048",
                     "--min-response-len", "4", "--max-response-len", "12", "--summary-out", str(self.summary_path),
                     *extra]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def waiting_for(self, version: int) -> bool:
        return f"{WAITING} {version} " in self.log()

    def summary(self) -> dict:
        return json.loads(self.summary_path.read_text())

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)


class SlowTrainer:
    """Reads rollout.turns; publishes version v+1 once every group of batch v is complete for every
    generator (namespace = adapter name of the rollout key) and ``may_publish(v+1)`` allows it."""

    def __init__(self, client_kwargs: dict, topics: Topics, namespaces: list[str | None]) -> None:
        self.consumer = KafkaConsumer(**client_kwargs, enable_auto_commit=False)
        partitions = [TopicPartition(topics.turns, p) for p in range(topics.turns_partitions)]
        self.consumer.assign(partitions)
        self.consumer.seek_to_beginning(*partitions)
        self.publisher = WeightPublisher(client_kwargs, topics)
        self.namespaces = namespaces
        self.version = 0
        self.finals: dict[tuple, set] = defaultdict(set)  # (namespace, group) -> keys with a final turn
        self.turns: list[tuple[str | None, int, list[int]]] = []  # (namespace, group, weight versions)
        self.ahead_while_waiting: list[int] = []

    def read(self) -> None:
        for batch in self.consumer.poll(timeout_ms=200).values():
            for record in batch:
                if control_kind(record.headers) is not None:
                    continue
                name, _slot, _kind, group, _ident = json.loads(record.key)
                (sample,), _ = decode_samples(record.value, TURN_FIELDS)
                self.turns.append((name, group, [int(v) for v in sample.weight_versions]))
                if TurnHeaders.from_kafka(record.headers).final:
                    self.finals[(name, group)].add(record.key)

    def batch_complete(self, batch: int) -> bool:
        return all(len(self.finals[(name, g)]) == N for name in self.namespaces for g in range(batch * G, (batch + 1) * G))

    def advance(self, may_publish=lambda version: True) -> None:
        self.read()
        while self.version < BATCHES - 1 and self.batch_complete(self.version) and may_publish(self.version + 1):
            self.publisher.publish(self.version + 1, step=self.version)
            self.version += 1

    def groups_seen(self) -> set[int]:
        return {group for _name, group, _versions in self.turns}

    def assert_bound_holds(self) -> None:
        assert self.turns
        for name, group, versions in self.turns:
            batch = group // G
            assert versions and min(versions) >= batch - K, (name, group, versions)

    def close(self) -> None:
        self.publisher.close()
        self.consumer.close()


def run_until_done(trainer: SlowTrainer, generators: list[Generator], may_publish=lambda version: True) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while any(g.proc.poll() is None for g in generators):
        assert time.monotonic() < deadline, "\n\n".join(g.log()[-3000:] for g in generators)
        trainer.advance(may_publish)
    for g in generators:
        assert g.proc.returncode == 0, g.log()[-3000:]
    trainer.read()


def wait_until(condition, what: str, trainer: SlowTrainer, generators: list[Generator]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert all(g.proc.poll() is None for g in generators), f"exited before {what}: " + generators[0].log()[-3000:]
        assert time.monotonic() < deadline, f"never {what}: " + generators[0].log()[-3000:]
        trainer.read()


def finals_on_topic(trainer: SlowTrainer, namespace: str | None = None) -> set[str]:
    return {key.decode() for (name, _g), keys in trainer.finals.items() if name == namespace for key in keys}


def test_a_generator_waits_for_the_slow_trainer_and_no_turn_is_staler_than_the_bound(client_kwargs, fresh, tmp_path):
    began = time.monotonic()
    trainer = SlowTrainer(client_kwargs, fresh, [None])
    gen = Generator(client_kwargs["bootstrap_servers"], fresh, tmp_path, "gen")
    try:
        # batch 2 (groups 4, 5) needs version 1: the generator holds there until the trainer publishes it
        wait_until(lambda: gen.waiting_for(1), "waited for version 1", trainer, [gen])
        time.sleep(0.5)
        trainer.read()
        assert trainer.groups_seen() <= set(range(2 * G)), "a group past the bound was generated"
        assert "before group 4 of batch 2, max staleness 1" in gen.log()
        run_until_done(trainer, [gen])
        trainer.assert_bound_holds()
        assert trainer.groups_seen() == set(range(GROUPS)) and trainer.version == BATCHES - 1
        summary = gen.summary()
        assert summary["episodes_finished"] == EPISODES and summary["weight_waits"] >= 1
        assert summary["live_version_min"] == 0 and summary["live_version_max"] >= BATCHES - 2
        assert {k for k, _a in summary["episodes"]} == finals_on_topic(trainer)
        said = [line for line in gen.log().splitlines() if WAITING in line and "rollout_bus.producers.staleness_gate" in line]
        assert said and all(" INFO rollout_bus.producers.staleness_gate: " in line for line in said)  # waiting is no warning
        flow = flow_records(client_kwargs, fresh)  # the generator's own account of its wait, on rollout.metrics
        assert flow and flow[-1]["final"] and {d["stage"] for d in flow} == {"generator"}
        last = flow[-1]["metrics"]
        assert last["rollout/flow/generator/gate_waits"] == summary["weight_waits"]
        assert last["rollout/flow/generator/gate_blocked_s"] == pytest.approx(summary["weight_waited_s"], abs=1e-3)
        assert 0 < last["rollout/flow/generator/gate_blocked_fraction"] < 1
    finally:
        gen.kill()
        trainer.close()
    assert time.monotonic() - began < 60


def flow_records(client_kwargs, topics: Topics) -> list[dict]:
    """Every flow record on the run's rollout.metrics, in order."""
    consumer = KafkaConsumer(topics.metrics, **client_kwargs, auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=3000)
    try:
        return [doc for doc in (json.loads(r.value) for r in consumer) if doc.get("kind") == "flow"]
    finally:
        consumer.close()


def test_two_generators_share_the_bound_both_wait_and_both_finish(client_kwargs, fresh, tmp_path):
    trainer = SlowTrainer(client_kwargs, fresh, ["left", "right"])
    gens = [Generator(client_kwargs["bootstrap_servers"], fresh, tmp_path, "left", "--adapters", "left",
                      "--seed", "1", "--run-id", f"left-{fresh.prefix}"),
            Generator(client_kwargs["bootstrap_servers"], fresh, tmp_path, "right", "--adapters", "right",
                      "--seed", "2", "--run-id", f"right-{fresh.prefix}")]
    try:
        wait_until(lambda: all(g.waiting_for(1) for g in gens), "both waited for version 1", trainer, gens)
        run_until_done(trainer, gens)
        trainer.assert_bound_holds()
        assert trainer.version == BATCHES - 1
        for g, name in zip(gens, ["left", "right"]):
            summary = g.summary()
            assert summary["episodes_finished"] == EPISODES and summary["weight_waits"] >= 1
            assert {k for k, _a in summary["episodes"]} == finals_on_topic(trainer, name)
            assert {group for n, group, _v in trainer.turns if n == name} == set(range(GROUPS))
    finally:
        for g in gens:
            g.kill()
        trainer.close()


def test_a_generator_killed_while_it_waits_finishes_after_a_restart_and_loses_nothing(client_kwargs, fresh, tmp_path):
    trainer = SlowTrainer(client_kwargs, fresh, [None])
    gen = Generator(client_kwargs["bootstrap_servers"], fresh, tmp_path, "gen", "--run-id", f"run-{fresh.prefix}")
    try:
        wait_until(lambda: gen.waiting_for(1), "waited for version 1", trainer, [gen])
        gen.kill()  # SIGKILL while it waits on the bound
        assert gen.proc.returncode == -signal.SIGKILL and not gen.summary_path.exists()
        first_life = gen.log()
        gen.start()  # the same arguments
        # the trainer would publish version 1 now (batch 0 is complete): hold it until the restarted
        # generator is waiting again, so it provably resumes behind the bound
        wait_until(lambda: gen.log().count(f"{WAITING} 1 ") > first_life.count(f"{WAITING} 1 "),
                   "waited again after the restart", trainer, [gen])
        run_until_done(trainer, [gen])
        trainer.assert_bound_holds()
        summary = gen.summary()
        assert summary["episodes_finished"] == EPISODES and summary["run_id"] == f"run-{fresh.prefix}"
        assert {k for k, _a in summary["episodes"]} <= finals_on_topic(trainer)  # duplicates of re-sent turns: fine
    finally:
        gen.kill()
        trainer.close()


def test_a_sigterm_while_waiting_stops_cleanly_and_leaves_the_run_open(client_kwargs, fresh, tmp_path):
    trainer = SlowTrainer(client_kwargs, fresh, [None])
    gen = Generator(client_kwargs["bootstrap_servers"], fresh, tmp_path, "gen")
    try:
        wait_until(lambda: gen.waiting_for(1), "waited for version 1", trainer, [gen])
        sent_at = time.monotonic()
        gen.signal(signal.SIGTERM)
        assert gen.proc.wait(timeout=15) == 128 + signal.SIGTERM, gen.log()[-3000:]
        assert time.monotonic() - sent_at < 10
        log = gen.log()
        assert "stopped (SIGTERM)" in log and "Traceback" not in log and not gen.summary_path.exists()
        time.sleep(0.5)
        trainer.read()
        assert set(finals_on_topic(trainer)) and trainer.groups_seen() <= set(range(2 * G))
    finally:
        gen.kill()
        trainer.close()
