"""Benchmark: turns per second through one stream worker, on the generator's default workload.

The default workload (``GenerateSettings()``) is generated once and encoded; ``--copies`` copies
of it, each under other rollout ids (so every copy is new episodes), make the run long enough
to time. A worker is started and warmed up (one episode through it, so group join and recovery
are not timed); then the other copies are published at once with kafka-python and the clock runs from
the first send until the last episode is on rollout.episodes. Prints one JSON line with
``turns_per_s`` (end to end: publish, stream stage, read back; the stage is the slow part).
``.venv/bin/python bench/stream_throughput.py [--bootstrap-servers 127.0.0.1:39092] [--copies 20]``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import uuid

from kafka import KafkaProducer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from changelog import start_worker, wait_for  # noqa: E402  (bench scripts share helpers)

from rollout_bus.sim.generator import iter_turns  # noqa: E402
from rollout_bus.wire.codec import encode_samples  # noqa: E402
from rollout_bus.config import GenerateSettings  # noqa: E402
from rollout_bus.kafka.admin import ensure_topics  # noqa: E402
from rollout_bus.wire.episode_record import TURN_FIELDS  # noqa: E402
from rollout_bus.wire.headers import TurnHeaders  # noqa: E402
from rollout_bus.wire.topics import Topics  # noqa: E402
from rollout_bus.wire.rollout_key import rollout_key_of  # noqa: E402


def encoded_copies(copies: int) -> tuple[list[tuple[bytes, bytes, list]], int]:
    """(key, value, headers) of every turn of every copy, and the number of episodes."""
    turns = list(iter_turns(GenerateSettings()))
    shift = 1 + max(s.rollout_id for s, _ in turns)
    records, finals = [], 0
    for c in range(copies):
        for sample, args in turns:
            sample = copy.copy(sample)
            sample.rollout_id += c * shift
            sample.index = sample.rollout_id
            key = rollout_key_of(sample).encode()
            headers = TurnHeaders(args["turn"], args["attempt"], args["final"], args["group_size"],
                                  time.time_ns() // 1_000_000).to_kafka()
            records.append((key, encode_samples([sample], TURN_FIELDS), headers))
            finals += bool(args["final"])
    return records, finals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=os.environ.get("ROLLOUT_BUS_BOOTSTRAP_SERVERS",
                                                                      "127.0.0.1:39092"))
    parser.add_argument("--copies", type=int, default=20)
    args = parser.parse_args()
    bootstrap = args.bootstrap_servers
    topics = Topics(prefix=f"bench{uuid.uuid4().hex[:8]}.")
    app_id = f"bench-throughput-{uuid.uuid4().hex[:8]}"
    ensure_topics({"bootstrap_servers": bootstrap}, topics)
    records, finals = encoded_copies(args.copies + 1)
    per_copy = len(records) // (args.copies + 1)
    warmup, records = records[-per_copy:], records[:-per_copy]  # the last copy warms the worker up
    warm_finals = finals // (args.copies + 1)
    finals -= warm_finals
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, batch_size=1 << 20,
                             max_request_size=64 << 20)
    log_path = os.path.join(tempfile.gettempdir(), f"{app_id}.log")
    worker = start_worker(bootstrap, topics, app_id, log_path)
    try:
        for key, value, headers in warmup:
            producer.send(topics.turns, key=key, value=value, headers=headers)
        producer.flush()
        wait_for(bootstrap, topics.episodes, warm_finals, timeout_s=120)
        began = time.monotonic()
        for key, value, headers in records:
            producer.send(topics.turns, key=key, value=value, headers=headers)
        producer.flush()
        published = time.monotonic() - began
        got = wait_for(bootstrap, topics.episodes, warm_finals + finals, timeout_s=600)
        elapsed = time.monotonic() - began
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        producer.close()
    print(json.dumps({"turns": len(records), "episodes": len(got) - warm_finals, "expected_episodes": finals,
                      "publish_s": round(published, 2), "elapsed_s": round(elapsed, 2),
                      "turns_per_s": round(len(records) / elapsed, 1), "worker_log": log_path}))


if __name__ == "__main__":
    main()
