"""TOPIC:PARTITION:OFFSET parsing for inspect and replay, and telling pipeline topics apart by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ConfigError
from rollout_bus.wire.positions import (PartitionRange, Position, RangeStart, parse_position, parse_range_start,
                                     topic_kind, topic_prefix, with_prefix)

topic_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", min_size=1,
                      max_size=60)


def test_a_full_position_parses_into_topic_partition_and_offset():
    assert parse_position("run42.rollout.turns:3:1500") == Position("run42.rollout.turns", 3, 1500)


def test_a_position_prints_back_as_it_was_written():
    assert str(parse_position("rollout.dlq:0:7")) == "rollout.dlq:0:7"


@settings(max_examples=200, deadline=None)
@given(topic=topic_names, partition=st.integers(0, 10_000), offset=st.integers(0, 2**63 - 1))
def test_any_valid_position_round_trips_through_its_text(topic, partition, offset):
    position = Position(topic, partition, offset)
    assert parse_position(str(position)) == position
    assert parse_range_start(str(position)) == RangeStart(topic, partition, offset)


@pytest.mark.parametrize("text", [
    pytest.param("rollout.turns", id="no-partition-or-offset"),
    pytest.param("rollout.turns:0", id="no-offset"),
    pytest.param("rollout.turns:0:1:2", id="too-many-parts"),
    pytest.param("rollout.turns:x:1", id="partition-not-a-number"),
    pytest.param("rollout.turns:0:-1", id="negative-offset"),
    pytest.param("rollout.turns:-1:0", id="negative-partition"),
    pytest.param("rollout.turns:0:1.5", id="fractional-offset"),
    pytest.param("rollout.turns:0: 1", id="space-in-offset"),
    pytest.param("rollout.turns:0:", id="empty-offset"),
    pytest.param(":0:1", id="empty-topic"),
    pytest.param("roll out:0:1", id="space-in-topic"),
    pytest.param("rollout/turns:0:1", id="slash-in-topic"),
    pytest.param("t" * 250 + ":0:1", id="topic-too-long"),
    pytest.param("rollout.turns:٣:1", id="non-ascii-digit"),
])
def test_a_malformed_position_is_refused_naming_the_value(text):
    with pytest.raises(ConfigError) as info:
        parse_position(text)
    assert repr(text) in str(info.value)


def test_a_bare_topic_means_every_partition_from_its_first_offset():
    assert parse_range_start("rollout.episodes") == RangeStart("rollout.episodes", None, None)


def test_topic_and_partition_mean_that_partition_from_its_first_offset():
    assert parse_range_start("run.rollout.episodes:2") == RangeStart("run.rollout.episodes", 2, None)


@pytest.mark.parametrize("text", ["", "rollout.episodes:", "rollout.episodes:a", "rollout.episodes:0:b",
                                  "rollout.episodes:0:1:2", "bad topic"])
def test_a_malformed_range_start_is_refused(text):
    with pytest.raises(ConfigError):
        parse_range_start(text)


@pytest.mark.parametrize("name, kind, prefix", [
    ("rollout.turns", "turns", ""),
    ("rollout.episodes", "episodes", ""),
    ("demo-20260101-1200-ab12.rollout.episodes", "episodes", "demo-20260101-1200-ab12."),
    ("t0123456789.rollout.dlq", "dlq", "t0123456789."),
    ("x.rollout.metrics", "metrics", "x."),
    ("x.rollout.shards", "shards", "x."),
    ("x.rollout.episodes.changelog", None, ""),
    ("something.else", None, ""),
])
def test_a_pipeline_topic_is_recognised_by_the_end_of_its_name(name, kind, prefix):
    assert topic_kind(name) == kind
    assert topic_prefix(name) == prefix


def test_a_short_topic_name_goes_under_the_prefix_and_a_full_one_stays():
    assert with_prefix("rollout.turns", "run7.") == "run7.rollout.turns"
    assert with_prefix("run7.rollout.turns", "run7.") == "run7.rollout.turns"
    assert with_prefix("rollout.turns", None) == "rollout.turns"


def test_a_range_counts_its_records_with_the_stop_exclusive():
    assert PartitionRange("t", 0, 5, 9).records == 4
    assert PartitionRange("t", 0, 5, 5).records == 0
    assert str(PartitionRange("t", 1, 0, 3)) == "t:1:[0,3)"
