"""partition_for is Kafka's default partitioner: the same partition as kafka-python's (Java's) murmur2."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st
from kafka.partitioner.default import murmur2 as kafka_python_murmur2

from rollout_bus.wire.partitioning import murmur2, partition_for


@given(st.binary(max_size=64), st.integers(min_value=1, max_value=64))
def test_the_partition_is_kafka_pythons(key, partitions):
    assert murmur2(key) == kafka_python_murmur2(key) & 0xFFFFFFFF
    assert partition_for(key, partitions) == (kafka_python_murmur2(key) & 0x7FFFFFFF) % partitions


def test_javas_own_value():
    assert murmur2(b"21") == -973932308 & 0xFFFFFFFF  # org.apache.kafka.common.utils.UtilsTest.testMurmur2


def test_a_topic_without_partitions_is_refused():
    with pytest.raises(ValueError, match="at least one partition"):
        partition_for(b"k", 0)
