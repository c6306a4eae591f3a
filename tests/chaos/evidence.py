"""What a run leaves behind, read for judging: shard digests, the longest episode, log excerpts, and the
episodes rollout.turns holds (for a run whose generator died without its summary)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from kafka import KafkaConsumer, TopicPartition

from rollout_bus.wire.headers import TurnHeaders, control_kind
from tests.topic_offsets import end_offsets


def shard_digests(shards_dir: Path) -> dict[str, str]:
    """sha256 of every shard file, by path relative to ``shards_dir``."""
    return {str(p.relative_to(shards_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(shards_dir.glob("batch-*/dp-*.safetensors"))}


def longest_episode_tokens(shards_dir: Path) -> int:
    """Response tokens of the longest episode in the shards (its segments summed, per rollout)."""
    from rollout_bus.model.shards import load_shard  # safetensors: only the runs that ask pay for it

    totals: dict[tuple[int, int, int], int] = {}
    for path in sorted(shards_dir.glob("batch-*/dp-*.safetensors")):
        for sample in load_shard(path).samples():
            key = (sample.adapter_slot, sample.group_index, sample.rollout_id)
            totals[key] = totals.get(key, 0) + int(sample.response_length)
    return max(totals.values(), default=0)


def log_excerpt(path: Path, lines: int, warnings: int) -> str:
    """The last ``warnings`` WARNING/ERROR/Traceback lines before the last ``lines`` lines, then those
    lines: a stage's failure usually shows in a warning long before its log ends."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    head = len(text) - lines
    flagged = [line for line in text[:max(0, head)] if " WARNING " in line or " ERROR " in line
               or line.startswith("Traceback")][-warnings:]
    gap = ["..."] if flagged else []
    return "\n".join(flagged + gap + text[-lines:])


def records_below(bootstrap: str, topic: str, ends: dict[int, int]) -> list:
    """Every record of ``topic`` below ``ends`` (per partition), read by a group-less consumer."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=5000)
    try:
        tps = [TopicPartition(topic, p) for p, end in ends.items() if end > 0]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out, deadline = [], time.monotonic() + 60
        while any(consumer.position(tp) < ends[tp.partition] for tp in tps) and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500).items():
                out += [r for r in records if r.offset < ends[tp.partition]]
        return out
    finally:
        consumer.close()


@dataclass
class LoggedEpisodes:
    """The episodes rollout.turns holds, by rollout key: what a generator that left no summary had sent."""

    finished: dict[str, int] = field(default_factory=dict)  # key -> attempt of its last final turn
    unfinished: set[str] = field(default_factory=set)  # turns stored, no final turn
    members: dict[int, set[str]] = field(default_factory=dict)  # group index -> its keys with any turn
    group_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def short_groups(self) -> set[int]:
        """Groups some of whose members have no turn in the log: they can only be written short."""
        return {g for g, keys in self.members.items() if len(keys) < self.group_sizes[g]}


def logged_episodes(bootstrap: str, topic: str) -> LoggedEpisodes:
    """Every data record of ``topic`` (control records skipped), read up to its end offsets now."""
    found, opened = LoggedEpisodes(), set()
    for record in records_below(bootstrap, topic, end_offsets(bootstrap, topic)):
        if control_kind(record.headers) is not None or not record.key:
            continue
        key, headers = record.key.decode(), TurnHeaders.from_kafka(record.headers)
        group = int(json.loads(key)[3])  # [adapter, slot, "rollout", group_index, id]
        found.members.setdefault(group, set()).add(key)
        found.group_sizes[group] = headers.group_size
        opened.add(key)
        if headers.final:
            found.finished[key] = max(headers.attempt, found.finished.get(key, headers.attempt))
    found.unfinished = opened - set(found.finished)
    return found
