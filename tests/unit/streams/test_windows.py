"""Window bookkeeping of the stream stage: bounds, replay-safe absorption, closing, merging partials."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.errors import ContractError
from rollout_bus.model.metrics import compute_metrics_from_samples
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.streams.windows import PartitionWindows, WindowEntry, window_bounds, window_key, window_record
from rollout_bus.wire.metrics_records import fold_window_records

def _episode(rollout_id: int, length: int, reward: float, adapter: str | None = None) -> list[Sample]:
    ref = AdapterRef(adapter, 0) if adapter else None
    return [Sample(group_index=0, index=rollout_id, rollout_id=rollout_id, tokens=[1] * (length + 1),
                   response_length=length, reward=reward, status=Status.COMPLETED, adapter=ref)]

@given(st.integers(0, 10**13), st.integers(1, 10**6))
@settings(max_examples=200, deadline=None)
def test_an_event_falls_in_exactly_the_window_that_holds_it(event_ms, size_ms):
    start, end = window_bounds(event_ms, size_ms)
    assert start <= event_ms < end and end - start == size_ms and start % size_ms == 0

def test_window_size_must_be_positive():
    with pytest.raises(ContractError):
        window_bounds(5, 0)

def test_an_entry_counts_each_final_offset_once():
    entry = WindowEntry(0, 1000, None, 2)
    assert entry.absorb(10, _episode(1, 3, 1.0))
    assert not entry.absorb(10, _episode(1, 3, 1.0))  # replayed after a crash
    assert not entry.absorb(7, _episode(2, 3, 1.0))
    assert entry.absorb(11, _episode(2, 5, 0.0))
    assert entry.stats.episodes == 2 and entry.offset == 11

def test_an_entry_round_trips_through_bytes():
    entry = WindowEntry(1000, 2000, "math", 3)
    entry.absorb(4, _episode(1, 3, 0.5, "math"))
    again = WindowEntry.from_bytes(entry.to_bytes())
    assert (again.start_ms, again.end_ms, again.adapter, again.partition, again.offset) == (1000, 2000, "math", 3, 4)
    assert again.stats == entry.stats
    with pytest.raises(ContractError):
        WindowEntry.from_bytes(b'{"start_ms": 1}')

def test_windows_close_once_the_watermark_passes_end_plus_grace_oldest_first():
    windows = PartitionWindows()
    windows.open = {b"b": 2000, b"a": 1000}
    windows.observe(1400)
    assert windows.due(500) == []
    windows.observe(1500)
    assert windows.due(500) == [b"a"]
    windows.observe(900)  # out-of-order records never move the watermark back
    windows.observe(2600)
    assert windows.due(500) == [b"a", b"b"]
    windows.closed(b"a")
    windows.closed(b"b")
    assert windows.closed_until_ms == 2000 and windows.open == {}
    assert windows.is_late((1000, 2000)) and not windows.is_late((2000, 3000))

def test_window_keys_separate_partitions_windows_and_adapters():
    keys = {window_key(s, a, p) for s in (0, 60_000) for a in (None, "x", "null") for p in (0, 1)}
    assert len(keys) == 12

def test_a_window_record_carries_metrics_partition_and_stats():
    entry = WindowEntry(0, 60_000, "math", 1)
    entry.absorb(3, _episode(1, 4, 1.0, "math"))
    doc = json.loads(window_record(entry, closed=True))
    assert (doc["kind"], doc["closed"], doc["partition"], doc["episodes"], doc["adapter"]) == \
        ("window", True, 1, 1, "math")
    assert doc["window"] == {"start_ms": 0, "end_ms": 60_000}
    assert doc["metrics"]["rollout/adapter/math/episode_response_length/mean"] == 4.0
    assert EpisodeStats.from_json(doc["stats"]) == entry.stats

def test_merging_partials_equals_the_batch_metrics_of_all_the_windows_episodes():
    episodes = [_episode(i, 3 + i % 4, i / 7, "a") for i in range(10)]
    records = []
    for partition in (0, 1):
        entry = WindowEntry(0, 60_000, "a", partition)
        for offset, episode in enumerate(episodes[partition::2]):
            entry.absorb(offset, episode)
            records.append(window_record(entry, closed=False))  # as they change: the last one wins
        records.append(window_record(entry, closed=True))
    records.append(json.dumps({"kind": "batch", "batch": 1}).encode())
    folds = fold_window_records(records)
    assert list(folds) == [(0, 60_000, "a")]
    (fold,) = folds.values()
    assert sorted(fold.partials) == [0, 1] and fold.closed and fold.unmerged == 0
    batch = compute_metrics_from_samples([s for e in episodes for s in e])
    got = fold.stats.metrics()
    assert got == {k: batch[k] for k in got}
    assert fold.stats.episodes == 10
