"""Record sizes: one setting, ``max_record_bytes``, sizes every topic, producer and consumer.

Kafka's defaults cap a record batch at about 1 MiB; a long agentic episode with its sampling masks
(128k response tokens) is several MB, up to tens of MB with wide supports. Rather than split
episodes across records, rollout-bus raises the limit where it is enforced, all from one number
(``KafkaSettings.max_record_bytes``, ``ROLLOUT_BUS_MAX_RECORD_BYTES``): the topics' (and the stream
state changelog's) ``max.message.bytes``, each producer's request and buffer sizes (consumers fetch
little per partition: a larger record still comes whole, and memory stays bounded by the fetch size,
not the backlog). kafka-python producers compress (lz4, its fast level); the stream worker's aiokafka
producer does not: aiokafka compresses lz4 only at level 9 (HC), measured at 28 MB/s on turn
payloads against 266 MB/s at level 1 for a 4% smaller result, which was 13% of the stream worker's
CPU (``bench/README.md``). A record over the limit anyway is dead-lettered
by reference (key, headers, source, reason ``too_large``), never fatal.

The broker refuses any request over its ``socket.request.max.bytes`` (100 MiB by default), so the
setting stays below that (``MAX_RECORD_BYTES_CEILING``).
"""

from __future__ import annotations

from typing import Any

from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES
HEADROOM_BYTES = 1 << 20  # key, headers and batch framing around the largest value
COMPRESSION = "lz4"
SEGMENT_BYTES_FLOOR = 256 << 20
FETCH_PARTITION_BYTES = 1 << 20  # a consumer's fetch per partition (a soft limit: see faust_config)


def _limit(max_record_bytes: int) -> int:
    return int(max_record_bytes) + HEADROOM_BYTES


def topic_config(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, str]:
    """Topic-level configs for every pipeline topic (and the stream state changelog): the record
    limit, and log segments at least twice that (a batch larger than a segment is refused)."""
    limit = _limit(max_record_bytes)
    return {"max.message.bytes": str(limit), "segment.bytes": str(max(SEGMENT_BYTES_FLOOR, 2 * limit))}


def producer_config(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
    """kafka-python ``KafkaProducer`` keywords: requests large enough, lz4."""
    return {"max_request_size": _limit(max_record_bytes), "compression_type": COMPRESSION}


def pending_bytes_limit(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> int:
    """Bytes a publisher lets wait unacknowledged at once (kafka-python 3 has no buffer pool of its
    own, so the publisher bounds it): room for two of the largest records, at least 32 MiB."""
    return max(32 << 20, 2 * _limit(max_record_bytes))


def consumer_config(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
    """kafka-python ``KafkaConsumer`` or aiokafka ``AIOKafkaConsumer`` fetch sizes (same names in both):
    small per partition, as for the stream worker (see ``faust_config``); a larger record still comes whole."""
    return {"max_partition_fetch_bytes": FETCH_PARTITION_BYTES, "fetch_max_bytes": 50 << 20}


def faust_config(max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
    """``faust.App`` settings: the producer's request size (uncompressed: see above), the consumer's fetch size.

    The fetch size per partition is small (``FETCH_PARTITION_BYTES``), not the record limit: the broker
    returns the first record batch of a fetch whole even when it is larger (KIP-74), so a record of
    any allowed size still comes through, while the worker no longer holds up to the record limit
    of every assigned partition's backlog in memory (peak RSS grew with the backlog)."""
    limit = _limit(max_record_bytes)
    return {"producer_max_request_size": limit, "producer_compression_type": None,
            "consumer_max_fetch_size": FETCH_PARTITION_BYTES}
