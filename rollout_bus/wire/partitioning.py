"""Which partition a keyed record belongs on: Kafka's default (Java) partitioner, spelled out.

Every turn of an episode must reach the same stream worker, so every producer has to put a key on
the same partition. The Java client and kafka-python hash the key bytes with murmur2; librdkafka's
default (``consistent_random``) hashes with CRC32 and lands elsewhere. The stream worker checks
each turn against ``partition_for`` and re-routes one that arrived on the wrong partition
(WIRE.md, "Partitioning"); a producer in another language should use this function's rule:

    partition = (murmur2(key_bytes) & 0x7fffffff) % partition_count

with murmur2 as in ``org.apache.kafka.common.utils.Utils.murmur2`` (seed 0x9747b28c). librdkafka
gets it with ``partitioner=murmur2_random``, kcat with ``-X topic.partitioner=murmur2_random``.
"""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """MurmurHash2 of ``data`` as Kafka computes it, as an unsigned 32-bit integer."""
    length = len(data)
    h = (_SEED ^ length) & _MASK32
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK32
        k ^= k >> 24
        k = (k * _M) & _MASK32
        h = ((h * _M) & _MASK32) ^ k
    tail = data[whole:]
    if tail:
        h ^= int.from_bytes(tail, "little")
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    return h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` on a topic of ``partitions`` partitions."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return (murmur2(bytes(key)) & 0x7FFFFFFF) % partitions
