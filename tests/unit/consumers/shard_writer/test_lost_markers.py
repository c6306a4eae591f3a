"""rollout_bus.consumers.shard_writer.lost_markers: a run whose end-of-run markers can only have been deleted ends."""

from __future__ import annotations

from rollout_bus.consumers.shard_writer.end_of_run import EndOfRunTracker
from rollout_bus.consumers.shard_writer.lost_markers import LostRange, RecordsLostError, runs_ended_by_loss
from tests.unit.consumers.shard_writer.test_end_of_run import marker

T = "t.rollout.episodes"


def lost(partition: int, first: int, count: int) -> LostRange:
    return LostRange(T, partition, first, count)


def test_nothing_lost_never_ends_a_run():
    tracker = EndOfRunTracker([0, 1])
    tracker.add(marker("r", 0, 1, 0))
    assert runs_ended_by_loss([0, 1], [], {}, tracker.unfinished()) is None
    assert runs_ended_by_loss([0, 1], [], {}, {}) is None


def test_every_record_deleted_markers_included_ends_the_run_no_marker_names():
    ranges = [lost(p, 0, 52) for p in range(4)]
    assert runs_ended_by_loss(range(4), ranges, {}, {}) == []


def test_a_partition_without_loss_still_gets_its_markers():
    ranges = [lost(p, 0, 52) for p in range(3)]  # partition 3 lost nothing: its markers are still to come
    assert runs_ended_by_loss(range(4), ranges, {}, {}) is None


def test_an_episode_after_the_loss_with_no_marker_seen_is_a_run_still_being_written():
    ranges = [lost(p, 0, 10) for p in range(2)]
    assert runs_ended_by_loss(range(2), ranges, {0: 12}, {}) is None
    assert runs_ended_by_loss(range(2), ranges, {0: 9, 1: 3}, {}) == []  # read before the loss: no sign of life
    again = ranges + [lost(0, 13, 4)]  # a later loss on partition 0 took what followed the episode at 12
    assert runs_ended_by_loss(range(2), again, {0: 12}, {}) == []


def test_a_run_ends_when_every_partition_owing_a_marker_lost_records():
    tracker = EndOfRunTracker([0, 1, 2])
    for t in (0, 1):
        tracker.add(marker("r", t, 2, 0))  # partition 0 has both markers
    tracker.add(marker("r", 1, 2, 1))  # partition 1 misses turns partition 0's, partition 2 both
    assert tracker.unfinished() == {"r": {1: [0], 2: [0, 1]}}
    assert runs_ended_by_loss(range(3), [lost(1, 0, 5), lost(2, 0, 7)], {1: 40}, tracker.unfinished()) == ["r"]
    assert runs_ended_by_loss(range(3), [lost(1, 0, 5)], {}, tracker.unfinished()) is None  # 2 never lost one


def test_a_run_whose_markers_all_arrived_owes_none():
    tracker = EndOfRunTracker([0])
    assert tracker.add(marker("r", 0, 1, 0))
    assert tracker.unfinished() == {}  # complete but not flushed yet (max_batches): not one to end for loss
    tracker.finished("r")
    assert tracker.unfinished() == {}
    assert runs_ended_by_loss([0], [lost(0, 0, 3)], {}, tracker.unfinished()) == []


def test_the_verdict_names_every_range_on_one_line():
    error = RecordsLostError([lost(0, 0, 52), lost(3, 7, 1)])
    text = str(error)
    assert "\n" not in text and "2 ranges, 53 records" in text
    assert f"{T} partition 0: offsets 0..51 (52 records)" in text
    assert f"{T} partition 3: offsets 7..7 (1 records)" in text
