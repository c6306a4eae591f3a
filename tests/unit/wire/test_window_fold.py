"""Folding a window's per-source-partition partials (``metrics_records.fold_window_records``), the one fold the
tail view, the report and the stream tests share."""

from __future__ import annotations

import json

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.wire.metrics_records import batch_metrics_record, fold_window_records, window_metrics_record


def _episode(rollout_id: int, length: int, reward: float, *, raw_reward: float | None = None) -> list[Sample]:
    metadata = {"raw_reward": raw_reward} if raw_reward is not None else {}
    return [Sample(group_index=0, index=rollout_id, rollout_id=rollout_id, tokens=[1] * (length + 1),
                   response_length=length, reward=reward, status=Status.COMPLETED, adapter=AdapterRef("math", 0),
                   metadata=metadata)]


def _stats(*episodes: list[Sample]) -> EpisodeStats:
    stats = EpisodeStats()
    for episode in episodes:
        stats.add_episode(episode)
    return stats


def _partial(partition: int | None, stats: EpisodeStats | None, *, start: int = 0, closed: bool = False,
             episodes: int | None = None) -> bytes:
    return window_metrics_record(start, start + 1000, "math", stats.metrics() if stats else {"x": 1.0},
                                 episodes=stats.episodes if stats else episodes or 0, closed=closed,
                                 partition=partition, offset=0, stats=stats.to_json() if stats else None)


def test_the_last_record_of_each_partition_replaces_earlier_ones_and_partitions_merge():
    first, second, other = _episode(1, 3, 1.0), _episode(2, 9, 0.0), _episode(3, 5, 1.0)
    batch = batch_metrics_record(1, {}, samples=1, manifest_path="m")
    folds = fold_window_records([_partial(0, _stats(first)), batch, _partial(1, _stats(other), closed=True),
                                 b'{"kind":"window","window":"?"}', _partial(0, _stats(first, second), closed=True),
                                 _partial(0, _stats(first), start=1000)])
    assert list(folds) == [(0, 1000, "math"), (1000, 2000, "math")]  # the order each window first appears
    fold = folds[(0, 1000, "math")]
    assert fold.stats == _stats(first, second, other) and fold.unmerged == 0 and fold.closed
    assert list(fold.partials) == [0, 1] and json.loads(_partial(0, _stats(first, second), closed=True)) == fold.latest


def test_a_window_is_open_while_any_partial_is():
    folds = fold_window_records([_partial(0, _stats(_episode(1, 3, 1.0)), closed=True),
                                 _partial(1, _stats(_episode(2, 3, 1.0)))])
    assert not folds[(0, 1000, "math")].closed


def test_merge_order_is_by_partition_or_by_first_arrival_and_decides_a_disputed_reward_source():
    by_metadata = _stats(_episode(1, 3, 0.0, raw_reward=1.0))  # this generator's rewards come from metadata
    by_reward = _stats(_episode(2, 3, 0.0))
    records = [_partial(1, by_metadata), _partial(0, by_reward)]
    by_partition = fold_window_records(records)[(0, 1000, "math")]
    by_arrival = fold_window_records(records, order="arrival")[(0, 1000, "math")]
    assert list(by_partition.partials) == [0, 1] and list(by_arrival.partials) == [1, 0]
    assert by_partition.stats.metrics()["episode_raw_reward"] == 0.0  # partition 0 first: rewards
    assert by_arrival.stats.metrics()["episode_raw_reward"] == 1.0  # partition 1 arrived first: metadata
    with pytest.raises(ContractError):
        fold_window_records(records, order="offset")


def test_partials_without_readable_stats_are_left_out_and_counted_or_raise_when_strict():
    good = _stats(_episode(1, 3, 1.0))
    garbage = {**json.loads(_partial(2, good)), "stats": "not stats"}
    records = [_partial(0, good), _partial(1, None, episodes=4), garbage]
    with pytest.raises(ContractError):
        fold_window_records(records)
    fold = fold_window_records(records, strict=False)[(0, 1000, "math")]
    assert fold.stats == good and fold.unmerged == 2
    (alone,) = fold_window_records([_partial(None, None, episodes=4)]).values()
    assert alone.stats is None and alone.unmerged == 1 and list(alone.partials) == [None]
    assert alone.latest["episodes"] == 4
