"""Pipeline throughput against the raw bus, measured side by side in one run on the local broker.

The same encoded turn records (the generator's default workload, scaled by --episodes) are
(1) produced with kafka-python and consumed back with no processing: the raw-bus ceiling; and
(2) produced into the full pipeline (stream worker + shard writer processes, started and warm):
turns in, shards out. Reports turns/s of both and their ratio, response tokens/s, p50/p99 latency
from a final turn's send to its episode record and to its batch's manifest on rollout.shards, and the
peak memory (VmHWM) of each stage process.

    .venv/bin/python bench/pipeline.py [--episodes 512] [--bootstrap-servers 127.0.0.1:39092]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from rich.console import Console

from producers.generator import iter_turns
from producers.publisher import producer_defaults
from rollout_bus.codec import encode_samples
from rollout_bus.config import GenerateSettings
from rollout_bus.kafka.local_broker import BrokerLease
from rollout_bus.metrics import get_rollout_key
from rollout_bus.records import TURN_FIELDS, TurnHeaders
from rollout_bus.tools.accounting import written_batches
from rollout_bus.tools.demo import DemoOptions, DemoRun
from rollout_bus.topics import rollout_key_string

LOG_APPEND = {"message.timestamp.type": "LogAppendTime"}  # broker clock: latency independent of producers


def encoded_turns(episodes: int, seed: int) -> tuple[list[tuple[bytes, bytes, dict]], int]:
    records, response_tokens = [], 0
    for sample, args in iter_turns(GenerateSettings(episodes=episodes, seed=seed)):
        key = rollout_key_string(get_rollout_key(sample, 0)).encode()
        records.append((key, encode_samples([sample], TURN_FIELDS), args))
        response_tokens += sample.response_length
    return records, response_tokens


def produce(bootstrap: str, topic: str, records) -> float:
    producer = KafkaProducer(bootstrap_servers=bootstrap, **producer_defaults())
    began = time.monotonic()
    for key, value, args in records:
        headers = TurnHeaders(turn=args["turn"], attempt=args["attempt"], final=args["final"],
                              group_size=args["group_size"], sent_at_ms=int(time.time() * 1000)).to_kafka()
        producer.send(topic, key=key, value=value, headers=headers)
    producer.flush()
    producer.close()
    return began


def raw_bus(bootstrap: str, records, partitions: int) -> float:
    """Seconds from the first send until a plain consumer, reading concurrently, has every record."""
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, partitions, 1, topic_configs=LOG_APPEND)])
    admin.close()
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None,
                             fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)
    consumer.poll(timeout_ms=1000)  # assigned and fetching before the clock starts
    done = threading.Event()

    def consume() -> None:
        seen = 0
        while seen < len(records):
            seen += sum(len(b) for b in consumer.poll(timeout_ms=200, max_records=10000).values())
        done.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    began = produce(bootstrap, topic, records)
    done.wait(timeout=600)
    elapsed = time.monotonic() - began
    reader.join(timeout=5)
    consumer.close()
    return elapsed


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def full_pipeline(bootstrap: str, records, episodes: int, out: Path) -> dict:
    run = DemoRun({"bootstrap_servers": bootstrap}, DemoOptions(episodes=episodes, out=out),
                  Console(file=io.StringIO()))
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(s.name, s.partitions, 1, topic_configs=LOG_APPEND) for s in run.topics.specs()])
    admin.close()
    run.start_stages(generator=False)
    time.sleep(12)  # both stages up: Faust joins its group and recovers, the writer assigns its partitions
    sent_at = {}
    try:
        began = produce(bootstrap, run.topics.turns, records)
        finals = {key for key, _v, args in records if args["final"]}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            placed = {e["key"] for m in written_batches(out / "shards").values()
                      for e in m.get("extra", {}).get("episodes", [])}
            if placed >= {k.decode() for k in finals}:
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - began
        memory = {name: vm_hwm_mb(stage.pid) for name, stage in run.stages.items()}
    finally:
        run.stop_stages()
    reader = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                           consumer_timeout_ms=3000)
    reader.subscribe([run.topics.turns, run.topics.episodes, run.topics.shards])
    episode_at, batch_at = {}, {}
    for record in reader:
        key = record.key.decode() if record.key else ""
        if record.topic == run.topics.turns and dict(record.headers).get("final") == b"1":
            sent_at[key] = int(dict(record.headers)["sent_at"])
        elif record.topic == run.topics.episodes:
            episode_at.setdefault(key, record.timestamp)
        elif record.topic == run.topics.shards:
            for episode in json.loads(record.value).get("extra", {}).get("episodes", []):
                batch_at.setdefault(episode["key"], record.timestamp)
    reader.close()
    return {"elapsed": elapsed, "memory": memory,
            "to_episode": [episode_at[k] - t for k, t in sent_at.items() if k in episode_at],
            "to_batch": [batch_at[k] - t for k, t in sent_at.items() if k in batch_at]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--out", type=Path, default=Path(f"/tmp/rollout-bus-bench-{uuid.uuid4().hex[:6]}"))
    args = parser.parse_args()
    print(f"generating {args.episodes} episodes (default workload) ...", file=sys.stderr)
    records, response_tokens = encoded_turns(args.episodes, args.seed)
    payload = sum(len(k) + len(v) for k, v, _ in records)
    print(f"{len(records)} turn records, {payload / 1e6:.1f} MB, {response_tokens} response tokens", file=sys.stderr)
    with BrokerLease(args.bootstrap_servers, echo=lambda m: print(m, file=sys.stderr)) as bootstrap:
        raw_before = raw_bus(bootstrap, records, partitions=4)
        print(f"raw bus done in {raw_before:.2f}s; running the pipeline ...", file=sys.stderr)
        result = full_pipeline(bootstrap, records, args.episodes, args.out)
        raw_after = raw_bus(bootstrap, records, partitions=4)
        raw_s = min(raw_before, raw_after)  # the ceiling: the better of the runs either side of the pipeline
        print(f"raw bus runs: {raw_before:.2f}s before, {raw_after:.2f}s after the pipeline", file=sys.stderr)
    pipe_s = result["elapsed"]
    raw_tps, pipe_tps = len(records) / raw_s, len(records) / pipe_s
    print(f"turns: {len(records)}  episodes: {args.episodes}  payload: {payload / 1e6:.1f} MB")
    print(f"raw bus (produce + consume, no processing): {raw_tps:8.0f} turns/s  ({raw_s:.2f}s)")
    print(f"full pipeline (turns in, shards out):       {pipe_tps:8.0f} turns/s  ({pipe_s:.2f}s), "
          f"{response_tokens / pipe_s:.0f} response tokens/s")
    print(f"pipeline / raw bus: {pipe_tps / raw_tps:.2f}x  (target >= 0.5x)")
    for name in ("to_episode", "to_batch"):
        values = result[name]
        print(f"latency final turn -> {name[3:]:<8}: p50 {percentile(values, 0.5):6.0f} ms  "
              f"p99 {percentile(values, 0.99):6.0f} ms  (n={len(values)})")
    print("peak memory (VmHWM): " + ", ".join(f"{k} {v:.0f} MB" for k, v in result["memory"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
