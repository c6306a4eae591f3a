"""End offsets of a topic, read once by a throwaway consumer: the log position that tests and the chaos faults
delete up to or compare against (one place, so both read it the same way)."""

from __future__ import annotations

from rollout_bus.kafka.reader import open_reader, partition_offsets


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """``{partition: end offset}`` of ``topic``; empty while the topic has no partitions in the metadata."""
    consumer = open_reader({"bootstrap_servers": bootstrap})
    try:
        return partition_offsets(consumer, topic) or {}
    finally:
        consumer.close()
