"""EpisodeStats: the windowed accumulator gives exactly the batch metrics, merges, and round-trips."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.metrics import EpisodeStats, compute_metrics_from_samples
from rollout_bus.model.sample import AdapterRef, Sample
from tests.unit.model.test_metrics import episodes_strategy, worked_example

EPISODE_KEYS = ("episode_response_length/", "episode_total_response_length/", "adapter/", "episode_raw_reward")


def episode_part(metrics: dict) -> dict:
    """The keys EpisodeStats is responsible for."""
    return {k: v for k, v in metrics.items() if k.startswith(EPISODE_KEYS)}


def stats_of(episodes) -> EpisodeStats:
    stats = EpisodeStats()
    for episode in episodes:
        stats.add_episode(episode)
    return stats


def flat(episodes) -> list[Sample]:
    return [segment for episode in episodes for segment in episode]


def one_source(episodes) -> bool:
    """Whether every episode's first segment picks the same reward source."""
    return len({"raw_reward" in episode[0].metadata for episode in episodes}) <= 1


def test_the_worked_example_accumulates_to_the_batch_numbers():
    samples = worked_example()
    stats = stats_of([samples[:2], samples[2:3], samples[3:]])
    assert stats.episodes == 3
    assert stats.metrics() == {
        "episode_response_length/mean": 5.0,
        "episode_response_length/median": 5.0,
        "episode_response_length/max": 6.0,
        "episode_response_length/min": 4.0,
        "episode_total_response_length/mean": 8.0,
        "episode_raw_reward": 0.0,
    }


def test_an_empty_accumulator_reports_what_an_empty_batch_reports():
    assert EpisodeStats().episodes == 0
    assert EpisodeStats().metrics() == episode_part(compute_metrics_from_samples([])) == {"episode_raw_reward": 0.0}


@settings(max_examples=200, deadline=None)
@given(episodes_strategy())
def test_metrics_equal_the_batch_metrics_of_all_the_episodes_samples_exactly(episodes):
    stats = stats_of(episodes)
    assert stats.episodes == len(episodes)
    assert stats.metrics() == episode_part(compute_metrics_from_samples(flat(episodes)))


@settings(max_examples=150, deadline=None)
@given(episodes_strategy(), st.data())
def test_merging_split_windows_equals_one_window_whichever_way_round(episodes, data):
    cut = data.draw(st.integers(0, len(episodes)))
    left, right = stats_of(episodes[:cut]), stats_of(episodes[cut:])
    whole = stats_of(episodes)
    assert left.merge(right) == whole
    assert left.merge(right).metrics() == whole.metrics()
    if one_source(episodes):
        assert right.merge(left) == whole


@settings(max_examples=100, deadline=None)
@given(episodes_strategy(max_episodes=9), st.data())
def test_merge_is_associative(episodes, data):
    first, second = sorted(data.draw(st.lists(st.integers(0, len(episodes)), min_size=2, max_size=2)))
    a, b, c = stats_of(episodes[:first]), stats_of(episodes[first:second]), stats_of(episodes[second:])
    assert a.merge(b).merge(c) == a.merge(b.merge(c)) == stats_of(episodes)


@settings(max_examples=150, deadline=None)
@given(episodes_strategy())
def test_json_round_trips_exactly(episodes):
    stats = stats_of(episodes)
    text = stats.to_json()
    again = EpisodeStats.from_json(text)
    assert again.to_json() == text
    assert again.metrics() == stats.metrics()
    assert again.episodes == stats.episodes


def test_json_is_compact_and_deterministic():
    samples = worked_example()
    text = stats_of([samples[:2], samples[2:3], samples[3:]]).to_json()
    assert " " not in text
    assert text == stats_of([samples[3:], samples[2:3], samples[:2]]).to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_merge_returns_a_new_accumulator_and_leaves_both_inputs_unchanged():
    samples = worked_example()
    left, right = stats_of([samples[:2]]), stats_of([samples[2:3]])
    before = (left.to_json(), right.to_json())
    merged = left.merge(right)
    assert merged.episodes == 2
    assert (left.to_json(), right.to_json()) == before
    merged.add_episode(samples[3:])
    assert (left.to_json(), right.to_json()) == before


def test_the_first_episode_picks_the_reward_source_as_the_first_sample_of_a_batch_does():
    with_metadata = [Sample(rollout_id=1, reward=0.0, metadata={"raw_reward": 1.0})]
    without = [Sample(rollout_id=2, reward=0.0)]
    forward = stats_of([with_metadata, without])
    backward = stats_of([without, with_metadata])
    batch_forward = compute_metrics_from_samples(with_metadata + without)
    batch_backward = compute_metrics_from_samples(without + with_metadata)
    assert forward.metrics()["episode_raw_reward"] == batch_forward["episode_raw_reward"] == 1.0
    assert backward.metrics()["episode_raw_reward"] == batch_backward["episode_raw_reward"] == 0.0
    assert EpisodeStats().merge(stats_of([without])).merge(stats_of([with_metadata])) == backward


def test_reward_means_do_not_depend_on_the_order_episodes_arrive_in():
    rewards = [0.1, 0.2, 0.3, 1e16, -1e16, 0.7]
    episodes = [[Sample(rollout_id=i, reward=r)] for i, r in enumerate(rewards)]
    forward, backward = stats_of(episodes), stats_of(episodes[::-1])
    assert forward.metrics() == backward.metrics()
    assert forward.metrics()["episode_raw_reward"] == pytest.approx(sum(rewards[:3] + rewards[5:]) / 6, rel=1e-12)


def test_the_state_stays_small_however_many_episodes_it_holds():
    stats = EpisodeStats()
    for i in range(20_000):
        adapter = AdapterRef("math", 0) if i % 2 else AdapterRef("code", 1)
        stats.add_episode([Sample(rollout_id=i, response_length=i % 50, reward=float(i % 2), adapter=adapter)])
    assert stats.episodes == 20_000
    assert len(stats.to_json()) < 2_000


@pytest.mark.parametrize(
    "segments",
    [
        pytest.param([], id="no segments"),
        pytest.param([Sample(rollout_id=1), Sample(rollout_id=2)], id="two rollout ids"),
        pytest.param([Sample(rollout_id=1, group_index=0), Sample(rollout_id=1, group_index=1)], id="two groups"),
        pytest.param([Sample(rollout_id=1, adapter=AdapterRef("a", 0)), Sample(rollout_id=1)], id="two adapters"),
        pytest.param([Sample(), Sample()], id="two id-less samples are two episodes"),
        pytest.param([{"rollout_id": 1}], id="not a Sample"),
    ],
)
def test_add_episode_rejects_anything_but_one_episode(segments):
    stats = EpisodeStats()
    with pytest.raises(ContractError):
        stats.add_episode(segments)
    assert stats.episodes == 0


def test_merge_rejects_other_types():
    with pytest.raises(ContractError):
        EpisodeStats().merge({"episodes": 1})


def _valid() -> dict:
    samples = worked_example()
    samples[0].reward = 0.5
    return json.loads(stats_of([samples[:2], samples[2:3], samples[3:]]).to_json())


def _broken(change) -> str:
    document = _valid()
    change(document)
    return json.dumps(document)


MALFORMED = [
    pytest.param(b"\xff\xfe", id="not utf-8"),
    pytest.param("{", id="truncated JSON"),
    pytest.param("[]", id="a list"),
    pytest.param("null", id="null"),
    pytest.param(_broken(lambda d: d.pop("source")), id="missing key"),
    pytest.param(_broken(lambda d: d.update(extra=1)), id="unknown key"),
    pytest.param(_broken(lambda d: d.update(version=2)), id="future version"),
    pytest.param(_broken(lambda d: d.update(version=1.0)), id="float version"),
    pytest.param(_broken(lambda d: d.update(source="guess")), id="unknown source"),
    pytest.param(_broken(lambda d: d.update(source=None)), id="no source with episodes"),
    pytest.param(_broken(lambda d: d["lengths"][0].__setitem__(2, -1)), id="negative total"),
    pytest.param(_broken(lambda d: d["lengths"][0].__setitem__(2, 24.0)), id="float total"),
    pytest.param(_broken(lambda d: d["lengths"][0].__setitem__(2, True)), id="bool total"),
    pytest.param(_broken(lambda d: d["lengths"][0][1].append([4, 1])), id="length listed twice"),
    pytest.param(_broken(lambda d: d["lengths"][0][1][0].__setitem__(1, 0)), id="zero count"),
    pytest.param(_broken(lambda d: d["lengths"][0].__setitem__(1, [])), id="empty histogram"),
    pytest.param(_broken(lambda d: d["lengths"].append(d["lengths"][0])), id="scope listed twice"),
    pytest.param(_broken(lambda d: d["lengths"][0].__setitem__(0, 3)), id="numeric scope"),
    pytest.param(_broken(lambda d: d["lengths"][0].pop()), id="short entry"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(1, "1/0")), id="zero denominator"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(1, "2/4")), id="unreduced fraction"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(1, "0.5")), id="decimal text"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(1, 0.5)), id="float sum"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(2, 0)), id="zero rollouts"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(2, 99)), id="more rollouts than episodes"),
    pytest.param(_broken(lambda d: d["rewards"]["reward"][0].__setitem__(0, "ghost")), id="reward for unknown adapter"),
    pytest.param(_broken(lambda d: d["rewards"].pop("metadata")), id="missing source table"),
    pytest.param('{"lengths":[],"rewards":{"metadata":[],"reward":[]},"source":null,"version":NaN}', id="NaN"),
]


@pytest.mark.parametrize("text", MALFORMED)
def test_from_json_rejects_malformed_documents_with_contract_error(text):
    with pytest.raises(ContractError):
        EpisodeStats.from_json(text)


def test_the_valid_document_the_malformed_table_breaks_is_accepted():
    document = _valid()
    stats = EpisodeStats.from_json(json.dumps(document))
    assert stats.episodes == 3
    assert stats.metrics()["episode_raw_reward"] == 0.5
