"""The built-in generator: seeded, real top-p/top-k sampling, forced tool tokens, compaction, retries, adapters."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from rollout_bus.producers.groups import parse_adapters, plan_groups
from rollout_bus.sim.generator import iter_turns, publish_generated
from rollout_bus.sim.policy import Policy
from rollout_bus.sim.sampling import SamplingParams, sample_tokens
from rollout_bus.wire.codec import decode_samples
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.model.sample import AdapterRef, Status
from rollout_bus.wire.rollout_key import rollout_key_of
from rollout_bus.model.turns import merge_samples

SMALL = dict(episodes=12, n_samples_per_prompt=4, vocab_size=4096, min_response_len=4, max_response_len=20)


def small(**overrides) -> GenerateSettings:
    return GenerateSettings(**{**SMALL, **overrides})


def records(settings: GenerateSettings) -> list[tuple[bytes, bytes, dict]]:
    from rollout_bus.wire.codec import encode_samples

    return [(rollout_key_of(s).encode(), encode_samples([s], TURN_FIELDS), args)
            for s, args in iter_turns(settings)]


def episodes_of(turns) -> dict:
    """Turns per (rollout key, attempt), in order."""
    grouped = defaultdict(list)
    for sample, args in turns:
        grouped[(rollout_key_of(sample), args["attempt"])].append((sample, args))
    return grouped


def sampled_positions(sample) -> np.ndarray:
    return np.flatnonzero(np.asarray(sample.loss_mask) == 1)


class MemoryPublisher:
    """Stands in for TurnPublisher: keeps what would have been sent."""

    def __init__(self) -> None:
        self.turns, self.raw, self.bytes_sent, self.flushed = [], [], 0, 0
        self.ended: list[tuple[str, int, int]] = []  # (run, turns before it, flushes before it)

    def publish_turn(self, sample, *, turn, final, attempt=0, group_size):
        self.turns.append((sample, dict(turn=turn, final=final, attempt=attempt, group_size=group_size)))
        self.bytes_sent += 1

    def send_raw(self, key, value, headers):
        self.raw.append((key, value, headers))

    def flush(self):
        self.flushed += 1

    def publish_end_of_run(self, run):
        self.ended.append((run, len(self.turns) + len(self.raw), self.flushed))
        return 4


# --- determinism ---------------------------------------------------------------------------------

def test_the_same_seed_publishes_the_same_keys_values_and_headers():
    first = records(small(adapters="math,code", compaction_prob=0.4, retry_prob=0.3))
    second = records(small(adapters="math,code", compaction_prob=0.4, retry_prob=0.3))
    assert first == second
    assert len(first) >= 12


def test_a_different_seed_publishes_different_records():
    assert records(small(seed=1)) != records(small(seed=2))


# --- sampling math against a brute-force reference -----------------------------------------------

def brute_force_support(logits: np.ndarray, temperature: float, top_p: float, top_k: int,
                        min_p: float = 0.0) -> tuple[list, np.ndarray]:
    """Sort, soft-max over the vocabulary, keep the smallest prefix reaching top_p, at most top_k, at least 1;
    then drop what is less likely than min_p times the top token."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    n = int(np.searchsorted(cum, top_p) + 1) if top_p < 1 else p.size  # first prefix whose mass reaches top_p
    if top_k > 0:
        n = min(n, top_k)
    kept = order[: max(1, n)]
    return [int(i) for i in kept if p[i] >= min_p * p[order[0]]], p


@hsettings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]),
       top_p=st.sampled_from([0.1, 0.5, 0.9, 0.95, 1.0]), top_k=st.sampled_from([-1, 1, 3, 8, 50]),
       min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_supports_and_log_probs_match_a_brute_force_reference(seed, temperature, top_p, top_k, min_p):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, 40, generator=gen) * 3
    draw = sample_tokens(logits, SamplingParams(temperature, top_p, top_k, min_p), gen)
    for b in range(16):
        expected, p = brute_force_support(logits[b].numpy(), temperature, top_p, top_k, min_p)
        assert draw.supports[b].tolist() == expected
        assert int(draw.tokens[b]) in expected
        want = math.log(p[draw.tokens[b]] / p[expected].sum())
        assert draw.log_probs[b] == pytest.approx(want, abs=1e-5)  # float32 logits, float64 reference


def test_draws_follow_the_renormalised_support_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=4)
    draw = sample_tokens(logits, params, torch.Generator().manual_seed(0))
    support, p = brute_force_support(logits[0].numpy(), 0.8, 0.9, 4)
    q = p[support] / p[support].sum()
    freq = np.bincount(draw.tokens, minlength=6)[support] / 4000
    assert set(draw.tokens.tolist()) <= set(support)
    np.testing.assert_allclose(freq, q, atol=0.03)


def test_policy_steps_are_peaked_like_a_language_model():
    policy = Policy(32768, seed=0)
    context = torch.arange(256)
    draw = sample_tokens(policy.logits(context, context + 7, torch.zeros(256)), SamplingParams(1.0, 0.95, 64),
                         torch.Generator().manual_seed(0))
    sizes = np.array([s.size for s in draw.supports])
    assert 1 <= np.median(sizes) <= 16  # mostly confident
    assert sizes.max() > 16  # sometimes uncertain


# --- the turns it yields -------------------------------------------------------------------------

def test_every_sampled_token_lies_in_its_recorded_support():
    for sample, _ in iter_turns(small(top_p=0.9, top_k=16)):
        mask, response = sample.rollout_sampling_mask, np.asarray(sample.tokens)[-sample.response_length:]
        assert len(mask) == sample.response_length
        for t in sampled_positions(sample):
            row = mask.row(int(t))
            assert response[t] in row and 1 <= row.size <= 16
        assert np.all(np.asarray(sample.rollout_log_probs) <= 0)


def test_tool_output_inside_a_response_is_forced_with_no_loss_and_zero_log_prob():
    turns = list(iter_turns(small(tool_call_prob=1.0, truncation_prob=0.0)))
    for sample, _ in turns:
        response = np.asarray(sample.tokens)[-sample.response_length:]
        forced = np.flatnonzero(np.asarray(sample.loss_mask) == 0)
        assert forced.size > 0
        for t in forced:
            assert sample.rollout_sampling_mask.row(int(t)).tolist() == [response[t]]
        assert np.all(np.asarray(sample.rollout_log_probs)[forced] == 0.0)
        assert len(sample.weight_versions) == 2  # one per engine call: before and after the tool


def test_turns_of_an_episode_merge_into_the_episode_with_forced_observations():
    turns = list(iter_turns(small(compaction_prob=0.0, retry_prob=0.0, truncation_prob=0.0, max_turns=3)))
    multi = [ts for ts in episodes_of(turns).values() if len(ts) == 3]
    assert multi
    for ts in multi:
        samples = [s for s, _ in ts]
        (merged,) = merge_samples(samples)
        assert list(merged.tokens) == list(samples[-1].tokens)
        trained = sum(int(np.sum(s.loss_mask)) for s in samples)
        assert int(np.sum(merged.loss_mask)) == trained
        observation = np.flatnonzero(np.asarray(merged.loss_mask) == 0)
        resp = np.asarray(merged.tokens)[-merged.response_length:]
        for t in observation:
            assert merged.rollout_sampling_mask.row(int(t)).tolist() == [resp[t]]
        assert [a["turn"] for _, a in ts] == [0, 1, 2] and [a["final"] for _, a in ts] == [False, False, True]


def test_each_turn_carries_only_its_own_response_and_the_final_turn_the_reward():
    for ts in episodes_of(iter_turns(small(retry_prob=0.0))).values():
        for sample, args in ts:
            assert sample.rollout_sampling_mask is not None and sample.rollout_log_probs is not None
            assert SMALL["min_response_len"] <= sample.response_length <= SMALL["max_response_len"] + 20
            assert (sample.reward is not None) == args["final"]
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
            assert sample.status == Status.COMPLETED or args["final"]
        assert isinstance(ts[-1][0].reward, float)


def test_compaction_starts_a_sibling_segment_with_the_same_rollout_id():
    turns = list(iter_turns(small(compaction_prob=1.0, retry_prob=0.0, max_turns=3)))
    multi = [ts for ts in episodes_of(turns).values() if len(ts) > 1]
    assert multi
    for ts in multi:
        segments = merge_samples([s for s, _ in ts])
        assert len(segments) == len(ts) > 1
        assert len({s.rollout_id for s in segments}) == 1


def test_an_aborted_attempt_is_retried_from_turn_zero_with_a_higher_attempt():
    turns = list(iter_turns(small(retry_prob=1.0, max_attempts=3)))
    by_key = defaultdict(list)
    for sample, args in turns:
        by_key[rollout_key_of(sample)].append(args)
    assert len(by_key) == 12
    for args in by_key.values():
        assert sorted({a["attempt"] for a in args}) == [0, 1, 2]
        assert [a["final"] for a in args].count(True) == 1 and args[-1]["final"] and args[-1]["attempt"] == 2
        for attempt in (0, 1, 2):
            assert [a["turn"] for a in args if a["attempt"] == attempt][0] == 0


def test_remove_sample_is_decided_once_per_episode():
    turns = list(iter_turns(small(episodes=24, remove_prob=0.5, retry_prob=0.5)))
    flags = defaultdict(set)
    for sample, _ in turns:
        flags[sample.rollout_id].add(sample.remove_sample)
    assert all(len(f) == 1 for f in flags.values())
    assert {True, False} == set().union(*flags.values())


def test_a_truncated_final_turn_runs_to_the_maximum_length():
    finals = [s for s, a in iter_turns(small(truncation_prob=1.0)) if a["final"]]
    assert finals and all(s.status == Status.TRUNCATED and s.response_length == 20 for s in finals)


def test_groups_alternate_adapters_and_each_adapter_numbers_its_own_samples_from_zero():
    settings = small(episodes=16, adapters="math,code")
    groups = plan_groups(**settings.group_plan())
    assert [(g.adapter.name, g.group_index) for g in groups] == [("math", 0), ("code", 1), ("math", 2), ("code", 3)]
    seen = defaultdict(set)
    for sample, _ in iter_turns(settings):
        assert sample.rollout_id == sample.index
        seen[sample.adapter].add((sample.group_index, sample.index))
    assert seen[AdapterRef("math", 0)] == {(2 * (i // 4), i) for i in range(8)}
    assert seen[AdapterRef("code", 1)] == {(2 * (i // 4) + 1, i) for i in range(8)}


def test_groups_are_published_in_order_with_their_episodes_interleaved_turn_by_turn():
    turns = list(iter_turns(small(episodes=10, retry_prob=0.0)))
    groups = [s.group_index for s, _ in turns]
    assert groups == sorted(groups)
    first_group = [(s.index, a["turn"]) for s, a in turns if s.group_index == 0]
    assert [t for _, t in first_group] == sorted(t for _, t in first_group)
    assert [i for i, t in first_group if t == 0] == [0, 1, 2, 3]
    assert {a["group_size"] for s, a in turns if s.group_index == 2} == {2}  # 10 episodes: 4 + 4 + 2


def test_faults_are_injected_only_when_asked():
    quiet = MemoryPublisher()
    summary = publish_generated(small(), quiet)
    assert quiet.raw == [] and summary.faults == []
    assert all(s.rollout_sampling_mask is not None for s, _ in quiet.turns)
    assert len(summary.episodes) == 12 and summary.turns_sent == len(quiet.turns) and quiet.flushed == 1

    loud = MemoryPublisher()
    summary = publish_generated(small(inject_faults=True), loud)
    assert {f["kind"] for f in summary.faults} == {"malformed", "finished", "replay-gap"}
    (key, value, headers), = loud.raw
    with pytest.raises(ValueError):
        decode_samples(value, TURN_FIELDS)
    gap = [ts for k, ts in episodes_of(loud.turns).items() if k[0] == '[null,null,"rollout",0,0]']
    final = [s for ts in gap for s, a in ts if a["final"]]
    assert len(final) == 1 and final[0].rollout_sampling_mask is None
    assert len(merge_samples([s for ts in gap for s, _ in ts])) > 1  # the replay gap splits the episode
    late_sample, late = loud.turns[-1]
    assert not late["final"] and late["turn"] > 0


def test_a_run_is_closed_after_everything_it_sent_and_named_in_the_summary():
    publisher = MemoryPublisher()
    summary = publish_generated(small(inject_faults=True, run_id="run-7"), publisher)
    assert publisher.ended == [("run-7", len(publisher.turns) + len(publisher.raw), 1)]
    assert summary.run_id == "run-7" and summary.end_of_run_partitions == 4
    assert summary.to_json()["run_id"] == "run-7" and summary.to_json()["end_of_run_partitions"] == 4


def test_each_run_gets_a_fresh_id_and_no_end_of_run_leaves_it_open():
    first, second = MemoryPublisher(), MemoryPublisher()
    a, b = publish_generated(small(), first), publish_generated(small(), second)
    assert a.run_id != b.run_id and len(a.run_id) == 32 and int(a.run_id, 16) >= 0
    assert [run for run, _, _ in first.ended] == [a.run_id]

    shared = MemoryPublisher()
    summary = publish_generated(small(run_id="shared", end_of_run=False), shared)
    assert shared.ended == [] and summary.end_of_run_partitions == 0 and summary.run_id == "shared"


def test_unusable_settings_are_refused():
    with pytest.raises(ConfigError):
        list(iter_turns(small(min_response_len=30, max_response_len=20)))
    with pytest.raises(ConfigError):
        parse_adapters("math,math")
    assert parse_adapters("") == [None]


# --- the staleness gate ----------------------------------------------------------------------------

def gated(watcher, groups_per_batch=1, max_staleness=None):
    from rollout_bus.producers.staleness_gate import StalenessGate
    from rollout_bus.wire.run_record import RunBatching

    return StalenessGate(watcher, RunBatching(groups_per_batch, "step", max_staleness))


def test_a_gate_stamps_every_engine_call_with_the_live_version_and_changes_nothing_else():
    from tests.unit.producers.test_staleness_gate import FakeWatcher

    plain = list(iter_turns(small(tool_call_prob=0.5)))
    followed = list(iter_turns(small(tool_call_prob=0.5), gated(FakeWatcher(version=7))))
    assert len(plain) == len(followed)
    for (a, a_args), (b, b_args) in zip(plain, followed):
        assert a_args == b_args and np.array_equal(a.tokens, b.tokens) and a.reward == b.reward
        assert a.weight_versions == ["0"] * len(a.weight_versions)
        assert b.weight_versions == ["7"] * len(a.weight_versions)


def test_a_group_starts_only_once_the_gate_admits_it_and_carries_the_version_it_was_admitted_under():
    from tests.unit.producers.test_staleness_gate import FakeWatcher

    watcher = FakeWatcher(version=0, published=[1, 2])
    turns = list(iter_turns(small(episodes=12, n_samples_per_prompt=4), gated(watcher, 1, 0)))
    assert watcher.waited_for == [1, 2]  # synchronous: group g (= batch g) waits for version g
    groups = [s.group_index for s, _ in turns]
    assert groups == sorted(groups)
    for sample, _ in turns:
        assert {int(v) for v in sample.weight_versions} == {sample.group_index}


def test_the_summary_names_the_live_versions_seen_and_the_waits():
    from tests.unit.producers.test_staleness_gate import FakeWatcher

    summary = publish_generated(small(), MemoryPublisher(), gate=gated(FakeWatcher(0, [1, 2]), 1, 0))
    doc = summary.to_json()
    assert (doc["live_version_min"], doc["live_version_max"], doc["weight_waits"]) == (0, 2, 2)
    plain = publish_generated(small(), MemoryPublisher()).to_json()
    assert (plain["live_version_min"], plain["live_version_max"], plain["weight_waits"]) == (None, None, 0)


# --- interrupted turns ------------------------------------------------------------------------------

class TickingWatcher:
    """The trainer publishing a new version every ``every`` looks at the weights: versions change mid-turn."""

    def __init__(self, every: int) -> None:
        self.every, self.refreshes = every, 0

    @property
    def version(self) -> int:
        return self.refreshes // self.every

    def refresh(self) -> int:
        self.refreshes += 1
        return self.version

    def wait_for(self, min_version, **_):
        raise AssertionError("no bound in these tests")


def test_turns_interrupted_by_new_weights_merge_into_exactly_the_uninterrupted_episodes():
    from rollout_bus.model.sample import Status
    from rollout_bus.model.turns import merge_samples

    settings = dict(episodes=12, tool_call_prob=0.4, max_turns=3)
    plain = episodes_of(iter_turns(small(**settings), gated(TickingWatcher(every=5))))
    cut = episodes_of(iter_turns(small(**settings, interrupt_prob=1.0), gated(TickingWatcher(every=5))))
    assert plain.keys() == cut.keys()
    interrupted = 0
    for key, turns in cut.items():
        assert [args["turn"] for _, args in turns] == list(range(len(turns)))  # later turns moved up
        assert [args["final"] for _, args in turns].count(True) <= 1
        aborted = [s for s, _ in turns if s.status == Status.ABORTED]
        interrupted += len(aborted)
        whole, split = merge_samples([s for s, _ in plain[key]]), merge_samples([s for s, _ in turns])
        assert len(whole) == len(split)
        seen = set()
        for a, b in zip(whole, split):
            assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
            assert np.array_equal(a.rollout_log_probs, b.rollout_log_probs)
            assert a.rollout_sampling_mask == b.rollout_sampling_mask and a.reward == b.reward
            assert a.response_length == b.response_length and a.status == b.status
            versions = np.asarray(b.rollout_token_versions)
            assert versions.size == b.response_length and set(versions[np.asarray(b.loss_mask) == 0]) <= {-1}
            assert np.all(versions[np.asarray(b.loss_mask) == 1] >= 0)
            seen |= set(versions[versions >= 0].tolist())
        if aborted:  # the cut turn's two parts ran under the old and the new weights
            assert len(seen) >= 2
    assert interrupted > 0  # the weights changed under some turns, and each of those was cut


def test_no_interruption_without_a_version_change_or_with_interrupt_prob_zero():
    from rollout_bus.model.sample import Status

    for gate, prob in ((None, 1.0), (gated(TickingWatcher(every=5)), 0.0)):
        turns = list(iter_turns(small(episodes=8, interrupt_prob=prob), gate))
        assert not [s for s, _ in turns if s.status == Status.ABORTED]
