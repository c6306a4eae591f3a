"""The runs behind bench/pipeline.py: workloads, the raw bus, and one pipeline run (at full speed or paced).

Helpers only; ``bench/pipeline.py`` is the script. Every pipeline run is a fresh ``DemoRun`` (its own
topics, consumer groups and out dir), its stages are stopped whatever happens, and its topics are
deleted afterwards unless asked to keep them.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from rich.console import Console

from rollout_bus.sim.generator import iter_turns
from rollout_bus.producers.publisher import producer_defaults
from rollout_bus.wire.codec import encode_samples
from rollout_bus.config import GenerateSettings
from rollout_bus.kafka.limits import topic_config
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.shard_announcement import parse_announcement
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.demo.run import DemoOptions, DemoRun
from rollout_bus.wire.rollout_key import rollout_key_of

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
IDLE_S = 2.0  # each stage's CPU while idle is measured this long before the clock starts, and subtracted
LOG_APPEND = {"message.timestamp.type": "LogAppendTime"}  # broker clock: latency independent of producers
GROUP = 4  # GenerateSettings' n_samples_per_prompt
WHOLE_BATCH = GROUP * DemoOptions().batching.groups_per_batch  # no end-of-run is sent: only whole batches get written
WORKLOADS = {  # name: GenerateSettings overrides (masks are always on: TURN_FIELDS has SAMPLING_MASK_FIELDS)
    "default": {},
    "long": {"min_response_len": 1000, "max_response_len": 4000},
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Workload:
    """The distinct turns generated once; ``records(copies)`` re-keys copies of them as new episodes."""

    name: str
    turns: list = field(default_factory=list)  # (Sample, publish kwargs)
    distinct: int = 0
    cpu_s: float = 0.0  # the built-in generator's CPU making ``turns`` (process time, its engine only)

    def records(self, copies: int) -> tuple[list[tuple[bytes, bytes, dict]], int]:
        """(key, value, publish kwargs) of every turn of ``copies`` copies, and their response tokens."""
        groups = 1 + max(s.group_index for s, _ in self.turns)
        ids = 1 + max(s.rollout_id for s, _ in self.turns)
        records, tokens = [], 0
        for c in range(copies):
            for sample, args in self.turns:
                if c:
                    sample = copy.copy(sample)
                    sample.group_index += c * groups
                    sample.rollout_id += c * ids
                    sample.index = sample.rollout_id
                key = rollout_key_of(sample).encode()
                records.append((key, encode_samples([sample], TURN_FIELDS), args))
                tokens += sample.response_length
        return records, tokens


def generate(name: str, distinct: int, seed: int) -> Workload:
    """The built-in generator's turns (its engine only: no Kafka), and the CPU they took (``cpu_s``)."""
    settings = GenerateSettings(episodes=distinct, seed=seed, **WORKLOADS[name])
    workload, shown, groups = Workload(name, distinct=distinct), time.monotonic(), math.ceil(distinct / GROUP)
    cpu = time.process_time()
    for sample, args in iter_turns(settings):
        workload.turns.append((sample, args))
        if time.monotonic() - shown > 5:
            shown = time.monotonic()
            log(f"  generating: group {sample.group_index + 1}/{groups}, {len(workload.turns)} turns so far")
    workload.cpu_s = time.process_time() - cpu
    return workload


def create_topics(conn: dict, specs: list[tuple[str, int, bool]]) -> None:
    configs = {**topic_config(), **LOG_APPEND}
    admin = KafkaAdminClient(**conn)
    try:
        admin.create_topics({name: {"num_partitions": partitions, "replication_factor": 1,
                                    "configs": {**configs, **({"cleanup.policy": "compact"} if compacted else {})}}
                             for name, partitions, compacted in specs})
    finally:
        admin.close()


def delete_topics(conn: dict, prefixes: list[str]) -> None:
    admin = KafkaAdminClient(**conn)
    try:
        names = [t for t in admin.list_topics() if any(t.startswith(p) for p in prefixes)]
        if names:
            admin.delete_topics(names)
    except Exception as exc:  # cleanup only: never hide the figures
        log(f"could not delete topics {prefixes}: {exc!r}")
    finally:
        admin.close()


def produce(conn: dict, topic: str, records, rate: float | None = None,
            check=None) -> tuple[float, float, dict[str, int]]:
    """Send every record (each at its scheduled time when ``rate`` turns/s is given; ``check()`` is
    called about every second meanwhile); return the monotonic start and end of sending and each
    final turn's sent_at (ms) by key."""
    producer = KafkaProducer(**conn, **producer_defaults())
    sent_at = {}
    try:
        # connected and holding the topic's metadata before the clock starts, as a long-lived generator is: else
        # the first records wait for both and reach the broker as one burst, adding ~40-80 ms to the first finals
        producer.partitions_for(topic)
        began = checked = time.monotonic()
        for i, (key, value, args) in enumerate(records):
            if check is not None and time.monotonic() - checked > 1:
                check()
                checked = time.monotonic()
            if rate:
                delay = began + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            now_ms = time.time_ns() // 1_000_000
            headers = TurnHeaders(turn=args["turn"], attempt=args["attempt"], final=args["final"],
                                  group_size=args["group_size"], sent_at_ms=now_ms).to_kafka()
            producer.send(topic, key=key, value=value, headers=headers)
            if args["final"]:
                sent_at[key.decode()] = now_ms
        sent = time.monotonic()
        producer.flush()
    finally:
        producer.close()
    return began, sent, sent_at


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used: ``/proc/<pid>/stat`` utime + stime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


PLAIN_CONSUMER = """
import json, os, sys, time
from kafka import KafkaConsumer
conn, topic, want = json.loads(os.environ["BENCH_CONN"]), sys.argv[1], int(sys.argv[2])
consumer = KafkaConsumer(topic, **conn, auto_offset_reset="earliest", group_id=None,
                         fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
consumer.poll(timeout_ms=1000)  # assigned and fetching before the clock starts
print("ready", flush=True)
began, seen = time.process_time(), 0
while seen < want:
    seen += sum(len(b) for b in consumer.poll(timeout_ms=200, max_records=10000).values())
print(json.dumps({"cpu_s": time.process_time() - began, "seen": seen}), flush=True)
consumer.close()
"""


def raw_bus(conn: dict, records, partitions: int = 4) -> tuple[float, float]:
    """Seconds from the first send until a plain consumer (kafka-python, no processing, a process of its own, as
    an operator would run one), reading concurrently, has every record; and the CPU seconds its process took
    meanwhile (every thread: kafka-python's network thread too)."""
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    create_topics(conn, [(topic, partitions, False)])
    reader = subprocess.Popen([sys.executable, "-c", PLAIN_CONSUMER, topic, str(len(records))], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "BENCH_CONN": json.dumps(conn)})  # not in argv: a password
    try:
        if reader.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the plain consumer did not start (exit {reader.wait(timeout=30)})")
        began = produce(conn, topic, records)[0]
        line = reader.stdout.readline()
        elapsed = time.monotonic() - began
        if not line:
            raise RuntimeError(f"the plain consumer exited {reader.wait(timeout=30)} before reading every record")
        cpu = json.loads(line)["cpu_s"]
        reader.wait(timeout=30)
    finally:
        if reader.poll() is None:
            reader.kill()
        delete_topics(conn, [topic])
    return elapsed, cpu


class ShardFollower:
    """Follows rollout.shards (no group) from its start; done once every final turn's key is in an
    announced batch. Records each key's first announcement time (LogAppendTime, ms)."""

    def __init__(self, conn: dict, topic: str, finals: set[str]):
        self.consumer = KafkaConsumer(**conn, group_id=None, enable_auto_commit=False,
                                      fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
        parts = [TopicPartition(topic, p) for p in sorted(self.consumer.partitions_for_topic(topic) or [0])]
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)
        for tp in parts:
            self.consumer.position(tp)  # positioned before the clock starts
        self.missing, self.batch_at = set(finals), {}
        self.done, self.done_at, self.batches = threading.Event(), None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set() and not self.done.is_set():
            for batch in self.consumer.poll(timeout_ms=100).values():
                for record in batch:
                    announcement = None if control_kind(record.headers) else parse_announcement(record.value)
                    if announcement is None:
                        continue
                    self.batches += 1
                    for episode in announcement.manifest.get("extra", {}).get("episodes", []):
                        self.batch_at.setdefault(episode["key"], record.timestamp)
                        self.missing.discard(episode["key"])
            if not self.missing:
                self.done_at = time.monotonic()
                self.done.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.consumer.close()


def read_first_times(conn: dict, topic: str) -> dict[str, int]:
    """Each key's first data record's timestamp on ``topic``, read to its current end."""
    consumer = KafkaConsumer(**conn, group_id=None, enable_auto_commit=False,
                             fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends, first, deadline = consumer.end_offsets(parts), {}, time.monotonic() + 120
        while any(consumer.position(tp) < ends[tp] for tp in parts) and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                for record in batch:
                    if record.key and not control_kind(record.headers):
                        first.setdefault(record.key.decode(), record.timestamp)
        return first
    finally:
        consumer.close()


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _check(run: DemoRun) -> None:
    """RuntimeError (with its log's last lines) if any stage exited: none should during a run."""
    for name, stage in run.stages.items():
        if stage.poll() is not None:
            raise RuntimeError(f"stage {name} exited with code {stage.poll()}; last lines of {stage.log_path}:\n"
                               f"{stage.log_tail()}")


def _wait_ready(conn: dict, run: DemoRun, workers: int, timeout_s: float = 120) -> None:
    """Until the Faust group is Stable with every worker and the shard writer has its partitions."""
    group, shards_log = run.stream_group, run.stages["shards"].log_path
    admin, deadline = KafkaAdminClient(**conn), time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            _check(run)
            try:
                state = admin.describe_groups([group])[group]
            except Exception:  # the group may not exist yet
                state = {}
            stable = state.get("group_state") == "Stable" and len(state.get("members", [])) == workers
            writer = shards_log.exists() and "reading topic=" in shards_log.read_text(errors="replace")
            if stable and writer:
                time.sleep(1.0)  # table recovery of the (empty) changelog after the assignment
                return
            time.sleep(0.5)
    finally:
        admin.close()
    raise RuntimeError(f"stages not ready after {timeout_s:.0f}s (logs: {run.out / 'logs'})")


def pipeline_run(conn: dict, records, episodes: int, out: Path, *, workers: int = 1, rate: float | None = None,
                 keep_topics: bool = False, timeout_s: float = 600, principals: Path | None = None) -> dict:
    """One fresh pipeline (``workers`` stream workers + shard writer), warm before the clock starts:
    seconds from the first send until every final turn's episode is in an announced batch, each
    stage's peak RSS, and per final turn the ms to its episode record and to its batch's announcement.
    ``principals``: a secured broker's (``conn`` is then its admin): each stage runs as its role."""
    run = DemoRun(conn, DemoOptions(episodes=episodes, out=out, stream_workers=workers, principals=principals),
                  Console(file=io.StringIO()))
    create_topics(conn, [(s.name, s.partitions, s.compacted) for s in run.topics.specs()])
    run.grant_roles()
    finals, follower = {key.decode() for key, _v, args in records if args["final"]}, None
    try:
        try:
            run.start_stages(generator=False)
            log(f"  starting {workers} stream worker(s) + shard writer (logs: {out / 'logs'}) ...")
            _wait_ready(conn, run, workers)
            follower = ShardFollower(conn, run.topics.shards, finals)
            pids = {name: stage.pid for name, stage in run.stages.items()}
            idle_from = {name: process_cpu_s(pid) for name, pid in pids.items()}
            time.sleep(IDLE_S)  # what each stage spends doing nothing (heartbeats, timers): not the turns' cost
            cpu_from = {name: process_cpu_s(pid) for name, pid in pids.items()}
            idle_rate = {name: (cpu_from[name] - idle_from[name]) / IDLE_S for name in pids}
            log(f"  stages ready; sending {len(records)} turns" + (f" paced at {rate:.0f} turns/s" if rate else ""))
            began, sent, sent_at = produce(conn, run.topics.turns, records, rate, check=lambda: _check(run))
            deadline, shown = time.monotonic() + timeout_s, time.monotonic()
            while not follower.done.wait(timeout=0.5):
                _check(run)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{len(follower.missing)} of {len(finals)} episodes not in any batch after "
                                       f"{timeout_s:.0f}s (logs: {out / 'logs'})")
                if time.monotonic() - shown > 5:
                    shown = time.monotonic()
                    log(f"  {len(finals) - len(follower.missing)}/{len(finals)} episodes in {follower.batches} batches")
            elapsed = follower.done_at - began
            cpu_to = {name: process_cpu_s(pid) for name, pid in pids.items()}  # polled: at most 0.5 s after done
            window = time.monotonic() - began
            cpu = {name: max(0.0, cpu_to[name] - cpu_from[name] - idle_rate[name] * window) for name in pids}
            memory = {name: vm_hwm_mb(stage.pid) for name, stage in run.stages.items()}
            log(f"  done in {elapsed:.2f}s ({follower.batches} batches); stopping the stages")
        finally:
            if follower is not None:
                follower.close()
            run.stop_stages()
        episode_at = read_first_times(conn, run.topics.episodes)
    finally:
        if not keep_topics:
            delete_topics(conn, [run.topics.prefix])  # the changelog too: the prefix scopes its name
    return {"elapsed": elapsed, "memory": memory, "sent_s": sent - began, "out": out, "cpu": cpu,
            "idle_cpu": idle_rate,
            "to_episode": [episode_at[k] - t for k, t in sent_at.items() if k in episode_at],
            "to_batch": [follower.batch_at[k] - t for k, t in sent_at.items() if k in follower.batch_at]}
