"""rollout_bus.consumers.shard_writer.end_of_run and rollout_bus.consumers.shard_writer.episodes.parse_record: when a run is over, from the log alone."""

from __future__ import annotations

import pytest

from rollout_bus.consumers.shard_writer.end_of_run import EndOfRunTracker
from rollout_bus.consumers.shard_writer.episodes import AbandonedEpisode, EndOfRunMarker, Episode, parse_record
from rollout_bus.errors import ContractError
from rollout_bus.wire.control_records import END_OF_RUN_KEY, Abandoned, EndOfRun
from rollout_bus.wire.episode_record import EpisodeInfo, encode_episode
from rollout_bus.wire.rollout_key import rollout_key_string
from tests.unit.consumers.shard_writer.test_batcher import segment


def marker(run: str, turns_partition: int, turns_partitions: int, partition: int, offset: int = 0):
    return EndOfRunMarker(run, turns_partition, turns_partitions, partition, offset)


def test_a_run_ends_only_when_every_episodes_partition_carried_every_turns_partitions_marker():
    tracker = EndOfRunTracker([0, 1])
    arrivals = [marker("r", t, 2, p) for p in (0, 1) for t in (0, 1)]
    assert [tracker.add(m) for m in arrivals] == [False, False, False, True]
    assert tracker.missing("r") == {}


def test_missing_says_which_markers_are_still_awaited():
    tracker = EndOfRunTracker([0, 1, 2])
    tracker.add(marker("r", 1, 3, 0))
    tracker.add(marker("r", 0, 3, 2))
    assert tracker.missing("r") == {0: [0, 2], 1: [0, 1, 2], 2: [1, 2]}


def test_duplicate_markers_count_once_and_are_held_with_the_others():
    tracker = EndOfRunTracker([0])
    assert not tracker.add(marker("r", 0, 2, 0, offset=5))
    assert not tracker.add(marker("r", 0, 2, 0, offset=6))  # a replayed copy
    assert tracker.add(marker("r", 1, 2, 0, offset=7))
    assert [m.offset for m in tracker.held("r")] == [5, 6, 7]
    assert [m.offset for m in tracker.finished("r")] == [5, 6, 7]
    assert tracker.is_finished("r") and not tracker.add(marker("r", 1, 2, 0, offset=9))


def test_runs_are_tracked_apart():
    tracker = EndOfRunTracker([0])
    assert not tracker.add(marker("a", 0, 2, 0))
    assert tracker.add(marker("b", 0, 1, 0))
    assert tracker.add(marker("a", 1, 2, 0))


def test_markers_that_disagree_on_the_partition_count_wait_for_the_larger():
    tracker = EndOfRunTracker([0])
    assert not tracker.add(marker("r", 0, 2, 0))
    assert not tracker.add(marker("r", 1, 3, 0))
    assert tracker.add(marker("r", 2, 2, 0))


# ---------------------------------------------------------------------------- parse_record


def test_parse_record_tells_episodes_abandoned_records_and_markers_apart():
    key = rollout_key_string((None, "rollout", 3, 11)).encode()
    info = EpisodeInfo(attempt=0, turns=1, group_size=2, final_sent_at_ms=0, event_time_ms=0)
    assert isinstance(parse_record(key, encode_episode([segment(3, 11)], info), info.headers(), partition=0,
                                   offset=0), Episode)
    gone = Abandoned(2, 4, "gap", "turn 1 missing", "turns:0:9")
    parsed = parse_record(key, gone.value(), gone.headers(), partition=1, offset=3)
    assert isinstance(parsed, AbandonedEpisode)
    assert (parsed.group, parsed.attempt, parsed.group_size, parsed.kind, parsed.source) == ((None, 3), 2, 4, "gap",
                                                                                             "turns:0:9")
    end = EndOfRun("run-1").forwarded(2, 4)
    assert parse_record(END_OF_RUN_KEY, end.value(), end.headers(), partition=1, offset=8) == EndOfRunMarker(
        "run-1", 2, 4, 1, 8)


@pytest.mark.parametrize("key, value, headers", [
    pytest.param(END_OF_RUN_KEY, EndOfRun("r").value(), EndOfRun("r").headers(), id="marker-not-forwarded"),
    pytest.param(END_OF_RUN_KEY, EndOfRun("r", 4, 4).value(), EndOfRun("r").headers(), id="marker-partition-out-of-range"),
    pytest.param(b"not a rollout key", Abandoned(0, 2, "k", "r", "s").value(), Abandoned(0, 2, "k", "r", "s").headers(),
                 id="abandoned-bad-key"),
    pytest.param(rollout_key_string((None, "rollout", 1, 1)).encode(), b"{}", Abandoned(0, 2, "k", "r", "s").headers(),
                 id="abandoned-bad-value"),
    pytest.param(b"k", b"{}", [("control", b"pause")], id="unknown-control"),
])
def test_parse_record_refuses_a_malformed_control_record(key, value, headers):
    with pytest.raises(ContractError):
        parse_record(key, value, headers, partition=0, offset=0)
