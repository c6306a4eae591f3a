"""rollout_bus.consumers.shard_writer.flow: a written batch's sample ages and discarded tokens, by cause."""

from __future__ import annotations

import dataclasses

import pytest

from rollout_bus.model.sample import Status
from rollout_bus.consumers.shard_writer.flow import batch_flow, episode_sent_at_ms, episode_takeover_tokens
from rollout_bus.wire.flow_metrics import DISCARD_CAUSES
from rollout_bus.wire.headers import HEADER_SENT_AT, HEADER_TAKEOVER_TOKENS
from rollout_bus.consumers.shard_writer.batcher import Batcher
from rollout_bus.wire.run_record import RunBatching
from tests.unit.consumers.shard_writer.test_decide import G, batch_3, decided, episode, segment

NOW_MS = 1_767_225_600_000


def sent(e, at_ms):
    return dataclasses.replace(e, headers=((HEADER_SENT_AT, str(at_ms).encode()),))


def test_ages_are_now_minus_each_written_episodes_final_sent_at_in_seconds():
    ages_s = [1.0, 2.0, 3.0, 10.0]
    episodes = [sent(episode(g, r), NOW_MS - int(a * 1000)) for (g, r), a in zip([(6, 0), (6, 1), (7, 0), (7, 1)], ages_s)]
    flow = batch_flow(decided(batch_3(*episodes)), NOW_MS)
    assert flow["flow/sample_age_s/p50"] == pytest.approx(2.5)  # numpy's linear percentile of 1, 2, 3, 10
    assert flow["flow/sample_age_s/p99"] == pytest.approx(3.0 + 0.97 * 7.0)
    assert flow["flow/sample_age_s/max"] == 10.0


def test_without_sent_at_there_is_no_age_and_a_bad_header_reads_as_none():
    flow = batch_flow(decided(batch_3(*(episode(g, r) for g in (6, 7) for r in (0, 1)))), NOW_MS)
    assert not [k for k in flow if "sample_age" in k]
    assert episode_sent_at_ms(dataclasses.replace(episode(6, 0), headers=((HEADER_SENT_AT, b"x"),))) == 0


def test_discarded_tokens_by_cause_and_their_fractions_of_every_token_decided_on():
    kept = [episode(6, 0), episode(6, 1), episode(7, 0)]  # 3 response tokens each
    aborted = dataclasses.replace(kept[1], segments=(dataclasses.replace(segment(6, 1, 3), remove_sample=True,
                                                                         status=Status.ABORTED),))
    removed = dataclasses.replace(kept[2], segments=(dataclasses.replace(segment(7, 0, 3), remove_sample=True),))
    stale = episode(7, 1, version=0)  # trained at step 3 with version 0: stale under max staleness 1
    decision = decided(batch_3(kept[0], aborted, removed, stale), max_staleness=1)
    assert [s.episode for s in decision.batch.stale] == [stale]
    flow = batch_flow(decision, NOW_MS)
    assert flow["flow/response_tokens"] == 12.0
    assert {c: flow[f"flow/discarded_tokens/{c}"] for c in ("aborted", "removed", "stale")} == {
        "aborted": 3.0, "removed": 3.0, "stale": 3.0}
    assert flow["flow/discarded_token_fraction/stale"] == 0.25 and flow["flow/discarded_token_fraction"] == 0.75


def taken_over(e, tokens):
    """``e`` as the stream worker sends it after takeovers threw ``tokens`` response tokens of it away."""
    return dataclasses.replace(e, headers=(*e.headers, (HEADER_TAKEOVER_TOKENS, str(tokens).encode())))


def test_tokens_a_takeover_threw_away_are_discarded_and_count_among_those_generated():
    kept = [taken_over(episode(6, 0), 5), episode(6, 1), taken_over(episode(7, 0), 2)]  # 3 response tokens each
    stale = taken_over(episode(7, 1, version=0), 4)  # a stale episode's takeovers were spent for this batch too
    decision = decided(batch_3(*kept, stale), max_staleness=1)
    assert [s.episode for s in decision.batch.stale] == [stale]
    flow = batch_flow(decision, NOW_MS)
    assert flow["flow/discarded_tokens/takeover"] == 11.0
    assert flow["flow/response_tokens"] == 12.0 + 11.0  # written 9 + stale 3 + thrown away by takeovers 11
    assert flow["flow/discarded_token_fraction/takeover"] == pytest.approx(11 / 23)
    assert flow["flow/discarded_token_fraction/stale"] == pytest.approx(3 / 23)
    assert flow["flow/discarded_token_fraction"] == pytest.approx(14 / 23)
    assert flow["flow/discarded_token_fraction"] == pytest.approx(
        sum(flow[f"flow/discarded_token_fraction/{c}"] for c in DISCARD_CAUSES))


def test_a_takeover_header_that_is_not_a_count_reads_as_none():
    for raw in (b"x", b"-3", b"\xff"):
        bad = dataclasses.replace(episode(6, 0), headers=((HEADER_TAKEOVER_TOKENS, raw),))
        assert episode_takeover_tokens(bad) == 0
    assert episode_takeover_tokens(episode(6, 0)) == 0


def test_a_batch_that_throws_nothing_away_says_zero_not_nothing():
    flow = batch_flow(decided(batch_3(*(episode(g, r) for g in (6, 7) for r in (0, 1)))), NOW_MS)
    assert flow["flow/discarded_token_fraction"] == 0.0 and flow["flow/discarded_tokens/stale"] == 0.0
    assert all(flow[f"flow/discarded_tokens/{c}"] == 0.0 for c in DISCARD_CAUSES)
    assert flow["flow/discarded_tokens/takeover"] == 0.0 and flow["flow/response_tokens"] == 12.0


def test_groups_written_short_are_counted_and_a_full_batch_counts_none():
    full = batch_flow(decided(batch_3(*(episode(g, r) for g in (6, 7) for r in (0, 1)))), NOW_MS)
    assert full["flow/incomplete_groups"] == 0.0
    batcher = Batcher(RunBatching(G, "step"))
    for e in (episode(6, 0), episode(6, 1), episode(7, 0)):  # group 7 lacks a member: the run ended without it
        batcher.add(e)
    [short] = batcher.flush()
    assert [g.complete for g in short.groups] == [True, False]
    assert batch_flow(decided(short), NOW_MS)["flow/incomplete_groups"] == 1.0
