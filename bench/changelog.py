"""Benchmark: bytes the stream stage writes to its state changelog, per byte of turns it receives.

The generator's default workload (``GenerateSettings()``: 64 episodes) is published to fresh,
prefixed topics; one stream worker (``python -m rollout_bus.cli.stream``) runs until every
episode is on rollout.episodes and is stopped; then every record of the changelog topic
``{prefix}{app_id}-state-changelog`` and of rollout.turns is read back with kafka-python and
``key + value`` bytes are summed (tombstones count their key). Prints one JSON line with
``changelog_bytes / turn_bytes`` (target <= 1.2; a state that re-wrote the growing list of an
episode's payloads on every turn would give about turns-per-episode / 2 + 1). Needs a broker:
``.venv/bin/python bench/changelog.py [--bootstrap-servers 127.0.0.1:39092] [--episodes 64]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

from kafka import KafkaConsumer, TopicPartition

from rollout_bus.sim.generator import iter_turns
from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.config import GenerateSettings
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.wire.topics import Topics


def start_worker(bootstrap: str, topics: Topics, app_id: str, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rollout_bus.cli.stream", "--bootstrap-servers", bootstrap, "--topic-prefix",
           topics.prefix, "--app-id", app_id, "--data-dir", tempfile.mkdtemp(prefix="rb-bench-")]
    return subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


def read_all(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list:
    """Every record of ``topic``, up to its end offsets when called."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    ends = consumer.end_offsets(partitions)
    records, deadline = [], time.monotonic() + timeout_s
    while any(consumer.position(tp) < ends[tp] for tp in partitions) and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
    consumer.close()
    return records


def wait_for(bootstrap: str, topic: str, count: int, timeout_s: float = 300.0) -> list:
    """Read ``topic`` from the start until ``count`` records arrived (or the timeout)."""
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None)
    records, deadline = [], time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    consumer.close()
    return records


def record_bytes(records) -> int:
    return sum(len(r.key or b"") + len(r.value or b"") for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=os.environ.get("ROLLOUT_BUS_BOOTSTRAP_SERVERS",
                                                                      "127.0.0.1:39092"))
    parser.add_argument("--episodes", type=int, default=GenerateSettings().episodes)
    args = parser.parse_args()
    topics = Topics(prefix=f"bench{uuid.uuid4().hex[:8]}.")
    app_id = f"bench-changelog-{uuid.uuid4().hex[:8]}"
    ensure_topics({"bootstrap_servers": args.bootstrap_servers}, topics)
    publisher = TurnPublisher(args.bootstrap_servers, topic=topics.turns)
    finals = 0
    for sample, kwargs in iter_turns(GenerateSettings(episodes=args.episodes)):
        publisher.publish_turn(sample, **kwargs)
        finals += bool(kwargs["final"])
    publisher.close()
    log_path = os.path.join(tempfile.gettempdir(), f"{app_id}.log")
    worker = start_worker(args.bootstrap_servers, topics, app_id, log_path)
    try:
        episodes = wait_for(args.bootstrap_servers, topics.episodes, finals)
        time.sleep(2.0)  # let the last changelog writes and the commit land
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    turns = read_all(args.bootstrap_servers, topics.turns)
    changelog = read_all(args.bootstrap_servers, f"{topics.group(app_id)}-state-changelog")
    turn_bytes, changelog_bytes = record_bytes(turns), record_bytes(changelog)
    print(json.dumps({"episodes": len(episodes), "turns": len(turns), "turn_bytes": turn_bytes,
                      "changelog_records": len(changelog), "changelog_bytes": changelog_bytes,
                      "ratio": round(changelog_bytes / turn_bytes, 4), "worker_log": log_path}))


if __name__ == "__main__":
    main()
