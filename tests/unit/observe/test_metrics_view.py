"""The operator's view: window partials merge exactly, the latest batch wins, dead letters are counted."""

from __future__ import annotations

import json

import pytest

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.episode_stats import EpisodeStats
from rollout_bus.model.metrics import compute_metrics_from_samples
from rollout_bus.observe.exporter import snapshot_families
from rollout_bus.kafka.lag import lag_rows
from rollout_bus.observe.metrics_view import MetricsView, metric_series
from rollout_bus.wire.metrics_records import batch_metrics_record, prefixed, window_metrics_record
from rollout_bus.model.sample import AdapterRef, Sample, Status


def _episode(rollout_id: int, length: int, reward: float, adapter: str | None = None) -> list[Sample]:
    ref = AdapterRef(adapter, 0) if adapter else None
    return [Sample(group_index=0, index=rollout_id, rollout_id=rollout_id, tokens=[1] * (length + 1),
                   response_length=length, reward=reward, status=Status.COMPLETED, adapter=ref)]


def _partial(start: int, adapter: str | None, partition: int, episodes: list[list[Sample]], *,
             closed: bool = False) -> bytes:
    """A window record as the stream stage publishes it (rollout_bus.streams.windows.window_record)."""
    stats = EpisodeStats()
    for episode in episodes:
        stats.add_episode(episode)
    return window_metrics_record(start, start + 1000, adapter, stats.metrics(), episodes=stats.episodes,
                                 closed=closed, partition=partition, offset=len(episodes), stats=stats.to_json())


def _letter(stage: str, kind: str, adapter: str | None = "math") -> DeadLetter:
    key = json.dumps([adapter, 0, "rollout", 0, 1]).encode() if adapter else None
    raw = DeadLetter(key, b"v", [("turn", b"0")], "why", stage, kind, "t:0:1")
    return DeadLetter.from_record(raw.key, raw.value, raw.record_headers())


def test_partials_of_one_window_merge_into_the_metrics_of_all_its_episodes():
    a = [_episode(1, 3, 1.0, "math"), _episode(2, 8, 0.0, "math")]
    b = [_episode(3, 5, 1.0, "math")]
    view = MetricsView()
    view.add_metrics(_partial(0, "math", 0, a))
    view.add_metrics(_partial(0, "math", 1, b))
    [window] = view.snapshot()["windows"]
    expected = compute_metrics_from_samples([s for e in a + b for s in e])
    for key, value in prefixed(expected).items():
        if "episode_response_length" in key or "episode_raw_reward" in key or "total_response" in key:
            assert window["metrics"][key] == value
    assert window["episodes"] == 3 and window["partitions"] == [0, 1] and window["adapter"] == "math"


def test_a_later_record_of_a_partial_replaces_the_earlier_one():
    view = MetricsView()
    view.add_metrics(_partial(0, None, 0, [_episode(1, 3, 1.0)]))
    view.add_metrics(_partial(0, None, 0, [_episode(1, 3, 1.0), _episode(2, 7, 0.0)], closed=True))
    [window] = view.snapshot()["windows"]
    assert window["episodes"] == 2 and window["closed"]
    assert window["metrics"]["rollout/episode_response_length/max"] == 7.0
    assert view.snapshot()["episodes"] == [{"adapter": None, "episodes": 2}]


def test_a_window_is_closed_only_when_every_partial_is():
    view = MetricsView()
    view.add_metrics(_partial(0, None, 0, [_episode(1, 3, 1.0)], closed=True))
    view.add_metrics(_partial(0, None, 1, [_episode(2, 3, 1.0)], closed=False))
    assert not view.snapshot()["windows"][0]["closed"]


def test_the_latest_window_of_each_adapter_is_shown_and_episodes_count_every_window():
    view = MetricsView(keep_windows=1)
    view.add_metrics(_partial(1000, "math", 0, [_episode(1, 3, 1.0, "math")]))
    view.add_metrics(_partial(0, "math", 0, [_episode(2, 4, 1.0, "math")]))  # an older window, late
    view.add_metrics(_partial(0, "code", 0, [_episode(3, 5, 1.0, "code"), _episode(4, 5, 1.0, "code")]))
    snapshot = view.snapshot()
    assert [(w["adapter"], w["window"]["start_ms"]) for w in snapshot["windows"]] == [("code", 0), ("math", 1000)]
    assert snapshot["episodes"] == [{"adapter": "code", "episodes": 2}, {"adapter": "math", "episodes": 2}]


def test_window_records_without_stats_are_taken_as_given():
    view = MetricsView()
    view.add_metrics(window_metrics_record(0, 1000, "math", {"x/mean": 2.5}, episodes=4, closed=True))
    [window] = view.snapshot()["windows"]
    assert window["metrics"] == {"rollout/x/mean": 2.5} and window["episodes"] == 4


def test_the_latest_batch_is_the_highest_sequence_and_a_reannounced_batch_counts_once():
    view = MetricsView()
    for seq in (0, 2, 1, 2):
        view.add_metrics(batch_metrics_record(seq, {"response_len/mean": float(seq)}, samples=8,
                                              manifest_path=f"/b{seq}/manifest.json"))
    snapshot = view.snapshot()
    assert snapshot["batch"]["batch"] == 2 and snapshot["batch"]["metrics"] == {"rollout/response_len/mean": 2.0}
    assert snapshot["batches"] == 3 and snapshot["batch_samples"] == 24


def test_dead_letters_are_counted_by_stage_and_kind():
    view = MetricsView()
    for letter in [_letter("stream", "decode"), _letter("stream", "decode"), _letter("shards", "mask-check")]:
        view.add_dead_letter(letter)
    assert view.snapshot(dlq_records=3)["dlq"] == {
        "counted": 3, "on_topic": 3,
        "by_reason": [{"stage": "shards", "kind": "mask-check", "count": 1},
                      {"stage": "stream", "kind": "decode", "count": 2}]}


def test_the_adapter_filter_keeps_that_adapters_windows_batch_metrics_and_dead_letters():
    view = MetricsView("math")
    view.add_metrics(_partial(0, "math", 0, [_episode(1, 3, 1.0, "math")]))
    view.add_metrics(_partial(0, "code", 0, [_episode(2, 3, 1.0, "code")]))
    view.add_metrics(batch_metrics_record(0, {"adapter/math/episode_raw_reward": 1.0,
                                              "adapter/code/episode_raw_reward": 0.0, "truncated_ratio": 0.5},
                                          samples=2, manifest_path="m"))
    for letter in [_letter("stream", "decode", "math"), _letter("stream", "decode", "code"),
                   _letter("stream", "key", None)]:
        view.add_dead_letter(letter)
    snapshot = view.snapshot()
    assert [w["adapter"] for w in snapshot["windows"]] == ["math"]
    assert snapshot["batch"]["metrics"] == {"rollout/adapter/math/episode_raw_reward": 1.0}
    assert snapshot["dlq"]["counted"] == 1 and snapshot["episodes"] == [{"adapter": "math", "episodes": 1}]


@pytest.mark.parametrize("value", [b"not json", b"[1, 2]", b'{"kind": "other"}', b'{"kind": "window"}', None,
                                   b'{"kind": "batch", "batch": "x", "samples": 1, "metrics": {}}'])
def test_unreadable_metrics_records_are_skipped_and_counted(value):
    view = MetricsView()
    view.add_metrics(value)
    assert view.snapshot()["skipped"] == 1 and view.snapshot()["windows"] == []


@pytest.mark.parametrize("name, adapter, expected", [
    ("rollout/adapter/math/episode_response_length/mean", None, ("rollout_episode_response_length_mean", "math")),
    ("rollout/episode_raw_reward", "code", ("rollout_episode_raw_reward", "code")),
    ("rollout/response_len/mean", None, ("rollout_response_len_mean", None)),
    ("rollout/weight-version/max", None, ("rollout_weight_version_max", None)),
])
def test_metric_names_become_prometheus_names_with_the_adapter_as_a_label(name, adapter, expected):
    assert metric_series(name, adapter) == expected


def test_exported_gauges_prefer_the_adapter_scoped_key_and_carry_the_kind():
    view = MetricsView()
    record = json.loads(window_metrics_record(0, 1000, "math", {"episode_raw_reward": 0.25,
                                                                "adapter/math/episode_raw_reward": 0.75},
                                              episodes=1, closed=False))
    view.add_metrics(json.dumps(record))
    view.add_metrics(batch_metrics_record(3, {"episode_raw_reward": 0.5}, samples=2, manifest_path="m"))
    families = {f.name: f for f in snapshot_families(view.snapshot())}
    samples = {(s.labels["adapter"], s.labels["kind"]): s.value for s in families["rollout_episode_raw_reward"].samples}
    assert samples == {("math", "window"): 0.75, ("", "batch"): 0.5}
    assert families["rollout_batches"].samples[0].value == 1


def test_lag_is_end_minus_committed_or_everything_on_the_partition_when_nothing_is_committed():
    rows = lag_rows("g", "t", ends={0: 10, 1: 5}, begins={0: 0, 1: 2}, committed={0: 7})
    assert [(r.partition, r.committed, r.lag) for r in rows] == [(0, 7, 3), (1, None, 3)]


def test_lag_rows_say_what_retention_took_and_when_the_group_nears_the_log_start():
    rows = lag_rows("g", "t", ends={0: 100, 1: 100, 2: 100, 3: 100}, begins={0: 40, 1: 40, 2: 0, 3: 40},
                    committed={0: 12, 1: 44, 2: 5, 3: 90})
    assert [(r.partition, r.lost, r.near_log_start) for r in rows] == [
        (0, 28, False),  # 12..39 deleted before the group read them
        (1, 0, True),    # 44 is within the oldest tenth of 40..99 while the partition deletes
        (2, 0, False),   # nothing deleted yet: no retention in play
        (3, 0, False)]   # far from the log start
    never = lag_rows("g", "t", ends={0: 10}, begins={0: 4}, committed={})
    assert (never[0].lost, never[0].lag) == (4, 6)  # a group that never read a partition that deleted 0..3
