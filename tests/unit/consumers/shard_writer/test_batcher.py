"""rollout_bus.consumers.shard_writer.batcher: grouping, dedupe, abandoned records, step/arrival batches, order inside a batch,
commit offsets, bounded memory of written keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.consumers.shard_writer.batcher import Batcher, Outcome
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.consumers.shard_writer.episodes import Episode, parse_episode
from rollout_bus.consumers.shard_writer.episodes import parse_record
from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.wire.control_records import Abandoned
from rollout_bus.wire.episode_record import EpisodeInfo, encode_episode
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.wire.rollout_key import rollout_key_string

MATH = AdapterRef("math", 1)
CODE = AdapterRef("code", 0)


def segment(group_index: int, rollout_id: int, *, adapter=None, length: int = 3, part: int = 0) -> Sample:
    tokens = np.arange(5 + length, dtype=np.int64) + 100 * part
    mask = RolloutSamplingMask.from_mask_list([[int(t), 7] for t in tokens[-length:]])
    return Sample(group_index=group_index, index=rollout_id, rollout_id=rollout_id, tokens=tokens,
                  response_length=length, reward=float(rollout_id % 2), loss_mask=[1] * length,
                  rollout_log_probs=[-0.5] * length, rollout_sampling_mask=mask, status=Status.COMPLETED,
                  adapter=adapter)


def episode(group_index: int, rollout_id: int, *, adapter=None, attempt: int = 0, group_size: int = 2,
            segments: int = 1, partition: int = 0, offset: int = 0) -> Episode:
    parts = tuple(segment(group_index, rollout_id, adapter=adapter, part=p) for p in range(segments))
    key = rollout_key_string((adapter, "rollout", group_index, rollout_id))
    return Episode(key, attempt, group_size, parts, partition, offset)


def ids(batch) -> list[tuple[int, int, int]]:
    return [(e.group_index, e.segments[0].rollout_id, e.attempt) for e in batch.episodes]


def feed(batcher: Batcher, episodes) -> list:
    batches = []
    for ep in episodes:
        batcher.add(ep)
        batches.extend(batcher.ready())
    return batches


# ---------------------------------------------------------------------------- step mode


def test_step_batch_holds_the_groups_of_its_index_range_once_all_are_complete():
    batcher = Batcher(RunBatching(2, "step"))
    eps = [episode(g, r, offset=10 * g + r) for g in (2, 3, 0, 1) for r in (0, 1)]
    batches = feed(batcher, eps)
    assert [b.seq for b in batches] == [1, 0]
    assert ids(batches[0]) == [(2, 0, 0), (2, 1, 0), (3, 0, 0), (3, 1, 0)]
    assert not batches[0].partial and all(g.complete for g in batches[0].groups)


def test_step_batch_is_not_due_while_a_group_of_its_range_is_missing_or_incomplete():
    batcher = Batcher(RunBatching(2, "step"))
    assert feed(batcher, [episode(0, 0), episode(0, 1), episode(1, 0)]) == []
    assert [b.seq for b in feed(batcher, [episode(1, 1)])] == [0]


_GROUPS = [(g, r, s) for g in range(6) for r in range(2 + g % 2) for s in (1 + (g + r) % 2,)]


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(len(_GROUPS) + 2))), st.booleans())
def test_step_batch_contents_do_not_depend_on_arrival_order(order, retried_first):
    """Same records (plus duplicates, and a retry that comes first) in any order: the same batches."""
    pool = [episode(g, r, group_size=2 + g % 2, segments=s, offset=i) for i, (g, r, s) in enumerate(_GROUPS)]
    pool.append(episode(0, 0, offset=90))                       # duplicate record of an episode
    pool.append(episode(4, 0, attempt=0, group_size=2, offset=92))  # and another
    records = [pool[i] for i in order]
    if retried_first:  # the aborted attempt's record never outruns its retry past the range's completion
        records.insert(0, episode(3, 1, attempt=1, group_size=3, offset=91))
    batcher = Batcher(RunBatching(2, "step"))
    batches = sorted(feed(batcher, records), key=lambda b: b.seq)
    assert [b.seq for b in batches] == [0, 1, 2]
    retried = 1 if retried_first else 0
    expected = [[(g, r, retried if (g, r) == (3, 1) else 0) for (g, r, _) in _GROUPS if g // 2 == k]
                for k in range(3)]
    assert [ids(b) for b in batches] == expected
    assert [[len(e.segments) for e in b.episodes] for b in batches] == [
        [s for (g, _, s) in _GROUPS if g // 2 == k] for k in range(3)]
    assert (batcher.counts["duplicate"], batcher.counts["superseded"]) == (2, retried)


def test_retry_that_arrives_after_its_range_was_formed_is_rejected_as_late():
    batcher = Batcher(RunBatching(1, "step"))
    feed(batcher, [episode(0, 0), episode(0, 1)])
    result = batcher.add(episode(0, 1, attempt=1, offset=9))
    assert result.outcome is Outcome.REJECTED and result.kind == "late"


def test_step_flush_writes_open_ranges_as_partial_batches_with_incomplete_groups():
    batcher = Batcher(RunBatching(2, "step"))
    feed(batcher, [episode(0, 0), episode(0, 1), episode(1, 0), episode(5, 0)])
    flushed = batcher.flush()
    assert [(b.seq, b.partial) for b in flushed] == [(0, True), (2, True)]
    assert [(g.group_index, g.episodes, g.complete) for g in flushed[0].groups] == [(0, 2, True), (1, 1, False)]
    assert batcher.pending_episodes == 0 and batcher.flush() == []
    assert batcher.next_seq == 3  # one past the highest range formed: what the end of run announces


def test_step_next_seq_follows_the_highest_range_formed_in_any_order():
    batcher = Batcher(RunBatching(2, "step"))
    assert batcher.next_seq == 0
    feed(batcher, [episode(g, r) for g in (2, 3) for r in (0, 1)])
    assert batcher.next_seq == 2
    feed(batcher, [episode(g, r) for g in (0, 1) for r in (0, 1)])
    assert batcher.next_seq == 2


def test_episode_of_an_already_formed_range_is_rejected_as_late():
    batcher = Batcher(RunBatching(1, "step"))
    [batch] = feed(batcher, [episode(0, 0), episode(0, 1)])
    result = batcher.add(episode(0, 2, offset=5))
    assert result.outcome is Outcome.REJECTED and result.kind == "late" and "batch 0" in result.reason


def test_copy_of_an_episode_in_a_formed_batch_is_a_duplicate_but_a_new_attempt_is_late():
    batcher = Batcher(RunBatching(1, "step"))
    feed(batcher, [episode(0, 0), episode(0, 1)])
    assert batcher.add(episode(0, 1, offset=7)).outcome is Outcome.DUPLICATE
    late = batcher.add(episode(0, 1, attempt=2, offset=8))
    assert late.outcome is Outcome.REJECTED and "attempt 2" in late.reason


def test_batches_found_on_disk_close_their_range_and_count_their_episodes_as_written():
    batcher = Batcher(RunBatching(2, "step"))
    batcher.mark_written(0, [(episode(0, 0).key, 0)], [(None, 0)])
    assert batcher.add(episode(0, 0)).outcome is Outcome.DUPLICATE
    assert batcher.add(episode(1, 0)).outcome is Outcome.REJECTED
    assert batcher.add(episode(2, 0)).outcome is Outcome.ACCEPTED


# ---------------------------------------------------------------------------- dedupe and attempts


def test_duplicate_episode_is_dropped_and_counted_once_in_its_batch():
    batcher = Batcher(RunBatching(1, "step"))
    assert batcher.add(episode(0, 0, offset=0)).outcome is Outcome.ACCEPTED
    assert batcher.add(episode(0, 0, offset=1)).outcome is Outcome.DUPLICATE
    [batch] = feed(batcher, [episode(0, 1, offset=2)])
    assert ids(batch) == [(0, 0, 0), (0, 1, 0)] and batcher.counts["duplicate"] == 1


def test_higher_attempt_replaces_the_lower_and_a_lower_one_arriving_later_is_dropped():
    batcher = Batcher(RunBatching(1, "step"))
    batcher.add(episode(0, 0, attempt=1, offset=0))
    assert batcher.add(episode(0, 0, attempt=0, offset=1)).outcome is Outcome.SUPERSEDED
    assert batcher.add(episode(0, 0, attempt=3, offset=2)).outcome is Outcome.REPLACED
    [batch] = feed(batcher, [episode(0, 1, offset=3)])
    assert ids(batch) == [(0, 0, 3), (0, 1, 0)]


def test_group_size_disagreement_and_overfull_group_are_rejected():
    batcher = Batcher(RunBatching(2, "step"))
    batcher.add(episode(0, 0, group_size=2))
    assert batcher.add(episode(0, 1, group_size=3)).kind == "group"
    batcher.add(episode(0, 1, group_size=2))
    over = batcher.add(episode(0, 2, group_size=2))
    assert over.outcome is Outcome.REJECTED and "one too many" in over.reason


def test_siblings_of_one_episode_stay_together_in_order():
    batcher = Batcher(RunBatching(1, "step"))
    [batch] = feed(batcher, [episode(0, 1, segments=3), episode(0, 0, segments=2)])
    samples = batch.samples()
    assert [s.rollout_id for s in samples] == [0, 0, 1, 1, 1]
    assert [int(s.tokens[0]) for s in samples] == [0, 100, 0, 100, 200]


# ---------------------------------------------------------------------------- arrival mode and order


def test_arrival_batch_is_the_first_groups_to_complete_in_completion_order():
    batcher = Batcher(RunBatching(2, "arrival"))
    batches = feed(batcher, [episode(9, 0), episode(4, 0), episode(7, 0), episode(7, 1), episode(9, 1),
                             episode(4, 1)])
    assert [b.seq for b in batches] == [0]
    assert [g.group_index for g in batches[0].groups] == [7, 9]
    [rest] = batcher.flush()
    assert (rest.seq, rest.partial, [g.group_index for g in rest.groups]) == (1, True, [4])


def test_samples_inside_a_batch_are_ordered_by_adapter_slot_group_and_rollout():
    batcher = Batcher(RunBatching(3, "arrival"))
    eps = [episode(2, 5, adapter=MATH), episode(2, 4, adapter=MATH), episode(1, 9, adapter=CODE),
           episode(1, 3, adapter=CODE), episode(0, 8), episode(0, 2)]
    [batch] = feed(batcher, eps)
    assert [(e.adapter, e.group_index, e.segments[0].rollout_id) for e in batch.episodes] == [
        (None, 0, 2), (None, 0, 8), (CODE, 1, 3), (CODE, 1, 9), (MATH, 2, 4), (MATH, 2, 5)]


# ---------------------------------------------------------------------------- commit offsets


def test_commit_offset_stops_at_the_first_pending_episode_of_each_partition():
    batcher = Batcher(RunBatching(1, "step"))
    batcher.add(episode(0, 0, partition=0, offset=4))
    batcher.skip(0, 5)
    batcher.add(episode(1, 0, partition=1, offset=9))
    assert batcher.commit_offsets() == {0: 4, 1: 9}
    [batch] = feed(batcher, [episode(0, 1, partition=1, offset=10)])
    assert batcher.commit_offsets() == {0: 4, 1: 9}  # formed but not yet written
    batcher.done(batch)
    assert batcher.commit_offsets() == {0: 6, 1: 9}


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(12))), st.integers(1, 3))
def test_commit_offsets_never_pass_a_pending_episode(order, groups_per_batch):
    pool = [episode(g, r, offset=0) for g in range(4) for r in range(3) if (g, r) != (3, 2)]
    pool.append(episode(0, 0, offset=0))  # a duplicate
    batcher = Batcher(RunBatching(groups_per_batch, "step"))
    next_offset = {0: 0, 1: 0}
    pending: dict[int, set[int]] = {0: set(), 1: set()}
    for i in order:
        base = pool[i]
        p = i % 2
        ep = Episode(base.key, base.attempt, 3, base.segments, p, next_offset[p])
        next_offset[p] += 1
        if batcher.add(ep).outcome is Outcome.ACCEPTED:
            pending[p].add(ep.offset)
        for batch in batcher.ready():
            batcher.done(batch)
            for e in batch.episodes:
                pending[e.partition].discard(e.offset)
        for partition, position in batcher.commit_offsets().items():
            assert position == min(pending[partition], default=next_offset[partition])
    for batch in batcher.flush():
        batcher.done(batch)
    assert batcher.commit_offsets() == {p: n for p, n in next_offset.items() if n}


# ---------------------------------------------------------------------------- parsing and config


def test_parse_episode_decodes_a_record_with_its_info_and_masks():
    segments = [segment(3, 11, adapter=MATH), segment(3, 11, adapter=MATH, part=1)]
    info = EpisodeInfo(attempt=2, turns=3, group_size=4, final_sent_at_ms=5, event_time_ms=6)
    key = rollout_key_string((MATH, "rollout", 3, 11))
    ep = parse_episode(key.encode(), encode_episode(segments, info), [("schema", b"1")], partition=2, offset=17)
    assert (ep.key, ep.attempt, ep.group_size, ep.group, ep.partition, ep.offset) == (key, 2, 4, (MATH, 3), 2, 17)
    assert len(ep.segments) == 2 and ep.segments[1].rollout_sampling_mask == segments[1].rollout_sampling_mask


@pytest.mark.parametrize("key, value", [
    pytest.param(b"k", b"not safetensors", id="garbage-value"),
    pytest.param(None, b"", id="no-key"),
    pytest.param(b"k", None, id="no-value"),
])
def test_parse_episode_raises_contract_error_for_a_bad_record(key, value):
    with pytest.raises(ContractError):
        parse_episode(key, value, partition=0, offset=0)


def test_parse_episode_refuses_segments_of_different_groups():
    payload = encode_episode([segment(1, 0), segment(2, 0)], EpisodeInfo(0, 2, 2, 0, 0))
    with pytest.raises(ContractError, match="group_index"):
        parse_episode(b"k", payload, partition=0, offset=0)


@pytest.mark.parametrize("groups, mode", [(0, "step"), (2, "fifo"), (True, "step")])
def test_batcher_refuses_bad_settings(groups, mode):
    with pytest.raises(ConfigError):
        Batcher(RunBatching(groups, mode))


# ---------------------------------------------------------------------------- abandoned episodes


def abandoned(group_index: int, rollout_id: int, *, adapter=None, attempt: int = 0, group_size: int = 2,
              partition: int = 0, offset: int = 0):
    """An ``abandoned`` control record as the stream stage sends it, parsed as the writer does."""
    key = rollout_key_string((adapter, "rollout", group_index, rollout_id)).encode()
    marker = Abandoned(attempt, group_size, "merge", f"final turn of {rollout_id} refused", "turns:1:7")
    return parse_record(key, marker.value(), marker.headers(), partition=partition, offset=offset)


def test_an_abandoned_record_completes_its_group_and_the_batch_is_written_without_it():
    batcher = Batcher(RunBatching(2, "step"))
    batches = feed(batcher, [episode(0, 0), episode(0, 1), episode(1, 0), abandoned(1, 1, offset=3)])
    [batch] = batches
    assert ids(batch) == [(0, 0, 0), (0, 1, 0), (1, 0, 0)] and not batch.partial and not batch.empty
    assert [(a.key, a.attempt, a.kind, a.source) for a in batch.abandoned] == [
        (abandoned(1, 1).key, 0, "merge", "turns:1:7")]
    assert [(g.group_index, g.episodes, g.abandoned, g.complete) for g in batch.groups] == [(0, 2, 0, True),
                                                                                             (1, 1, 1, True)]


@settings(max_examples=40, deadline=None)
@given(st.permutations(list(range(9))))
def test_batches_with_abandoned_records_do_not_depend_on_arrival_order(order):
    pool = [episode(0, 0), episode(0, 1), abandoned(1, 0), episode(1, 1), episode(2, 0), abandoned(2, 1),
            episode(3, 0), episode(3, 1), abandoned(1, 0)]  # the last: a duplicate of the control record
    batcher = Batcher(RunBatching(2, "step"))
    batches = sorted(feed(batcher, [pool[i] for i in order]), key=lambda b: b.seq)
    assert [ids(b) for b in batches] == [[(0, 0, 0), (0, 1, 0), (1, 1, 0)], [(2, 0, 0), (3, 0, 0), (3, 1, 0)]]
    assert [[a.key for a in b.abandoned] for b in batches] == [[abandoned(1, 0).key], [abandoned(2, 1).key]]
    assert batcher.counts["duplicate"] == 1 and batcher.pending_episodes == 0


def test_a_range_whose_groups_are_all_abandoned_is_empty_and_does_not_block_later_batches():
    batcher = Batcher(RunBatching(1, "step"))
    [empty] = feed(batcher, [abandoned(0, 0, offset=0), abandoned(0, 1, offset=1)])
    assert empty.seq == 0 and empty.empty and len(empty.abandoned) == 2
    assert batcher.commit_offsets() == {0: 0}  # held until the caller says the decision is done
    batcher.done(empty)
    assert batcher.commit_offsets() == {0: 2}
    [later] = feed(batcher, [episode(1, 0, offset=2), episode(1, 1, offset=3)])
    assert later.seq == 1 and ids(later) == [(1, 0, 0), (1, 1, 0)]


def test_an_episode_wins_over_an_abandoned_record_of_the_same_attempt_while_both_are_pending():
    for first, second in [(abandoned(0, 0, offset=0), episode(0, 0, offset=1)),
                          (episode(0, 0, offset=0), abandoned(0, 0, offset=1))]:
        batcher = Batcher(RunBatching(1, "step"))
        batcher.add(first)
        batcher.add(second)
        [batch] = feed(batcher, [episode(0, 1, offset=2)])
        assert ids(batch) == [(0, 0, 0), (0, 1, 0)] and batch.abandoned == ()


def test_a_higher_attempt_abandoned_record_supersedes_the_episode_of_a_lower_attempt():
    batcher = Batcher(RunBatching(1, "step"))
    batcher.add(episode(0, 0, attempt=0, offset=0))
    assert batcher.add(abandoned(0, 0, attempt=1, offset=1)).outcome is Outcome.REPLACED
    [batch] = feed(batcher, [episode(0, 1, offset=2)])
    assert ids(batch) == [(0, 1, 0)] and [a.attempt for a in batch.abandoned] == [1]


def test_a_control_record_of_a_formed_batch_is_a_duplicate_if_its_key_is_in_it_else_late():
    batcher = Batcher(RunBatching(1, "step"))
    feed(batcher, [episode(0, 0), abandoned(0, 1)])
    assert batcher.add(abandoned(0, 1, offset=5)).outcome is Outcome.DUPLICATE
    assert batcher.add(episode(0, 1, offset=6)).outcome is Outcome.DUPLICATE   # its key is in the batch, abandoned
    assert batcher.add(abandoned(0, 0, offset=7)).outcome is Outcome.DUPLICATE  # its key is in it, as an episode
    late = batcher.add(abandoned(0, 2, offset=8))
    assert late.outcome is Outcome.REJECTED and late.kind == "late"


def test_abandoned_record_with_a_disagreeing_group_size_is_rejected():
    batcher = Batcher(RunBatching(2, "step"))
    batcher.add(episode(0, 0, group_size=2))
    assert batcher.add(abandoned(0, 1, group_size=3)).kind == "group"


def test_flush_leaves_no_offsets_held_and_marks_episode_less_ranges_empty():
    batcher = Batcher(RunBatching(2, "step"))
    feed(batcher, [episode(0, 0, offset=0), abandoned(4, 0, offset=1)])
    flushed = batcher.flush()
    assert [(b.seq, b.partial, b.empty) for b in flushed] == [(0, True, False), (2, True, True)]
    for batch in flushed:
        batcher.done(batch)
    assert batcher.commit_offsets() == {0: 2}


def test_control_records_held_by_the_caller_stop_commits_until_released():
    batcher = Batcher(RunBatching(1, "step"))
    batcher.hold(1, 4)
    batcher.skip(1, 5)
    assert batcher.commit_offsets() == {1: 4}
    batcher.hold(1, 4)  # a duplicate is harmless: held and released together
    batcher.release(1, 4)
    batcher.release(1, 4)
    assert batcher.commit_offsets() == {1: 6}


# ---------------------------------------------------------------------------- bounded memory


def test_written_keys_are_forgotten_beyond_written_memory_and_looked_up_on_disk():
    on_disk: dict[int, dict[str, int]] = {}
    lookups: list[int] = []

    def lookup(seq):
        lookups.append(seq)
        return on_disk.get(seq)

    batcher = Batcher(RunBatching(1, "step"), written_memory=2, lookup=lookup)
    for g in range(6):
        [batch] = feed(batcher, [episode(g, 0, offset=2 * g), episode(g, 1, offset=2 * g + 1)])
        on_disk[batch.seq] = {e.key: e.attempt for e in batch.episodes}
        batcher.done(batch)
    assert batcher.remembered_keys == 2 * 2  # the two newest batches only
    assert batcher.add(episode(0, 1, offset=20)).outcome is Outcome.DUPLICATE and lookups == [0]
    assert batcher.add(episode(5, 1, offset=21)).outcome is Outcome.DUPLICATE and lookups == [0]  # in memory
    late = batcher.add(episode(1, 2, offset=22))
    assert late.outcome is Outcome.REJECTED and late.kind == "late"
    retry = batcher.add(episode(2, 0, attempt=1, offset=23))
    assert retry.outcome is Outcome.REJECTED and "attempt 0 was batched" in retry.reason


def test_without_a_lookup_a_forgotten_duplicate_is_late_not_a_new_group():
    batcher = Batcher(RunBatching(1, "step"), written_memory=1)
    for g in range(3):
        batcher.done(feed(batcher, [episode(g, 0), episode(g, 1)])[0])
    result = batcher.add(episode(0, 0, offset=9))
    assert result.outcome is Outcome.REJECTED and result.kind == "late" and batcher.pending_episodes == 0


def test_arrival_mode_forgets_keys_but_finds_the_closed_group_and_looks_it_up():
    on_disk: dict[int, dict[str, int]] = {}
    batcher = Batcher(RunBatching(1, "arrival"), written_memory=1, lookup=on_disk.get)
    for g in (7, 3, 5):
        [batch] = feed(batcher, [episode(g, 0), episode(g, 1)])
        on_disk[batch.seq] = {e.key: e.attempt for e in batch.episodes}
        batcher.done(batch)
    assert batcher.remembered_keys == 2
    assert batcher.add(episode(7, 1, offset=9)).outcome is Outcome.DUPLICATE
    assert batcher.add(episode(3, 2, offset=10)).kind == "late"


def test_a_formed_batch_is_never_forgotten_before_it_is_done():
    batcher = Batcher(RunBatching(1, "step"), written_memory=1)
    [first] = feed(batcher, [episode(0, 0), episode(0, 1)])
    for g in (1, 2, 3):
        batcher.done(feed(batcher, [episode(g, 0), episode(g, 1)])[0])
    assert batcher.add(episode(0, 1, offset=9)).outcome is Outcome.DUPLICATE  # batch 0 not done yet
    batcher.done(first)
    assert batcher.remembered_keys == 2


def test_batcher_refuses_a_written_memory_below_one():
    with pytest.raises(ConfigError):
        Batcher(RunBatching(1, "step"), written_memory=0)
