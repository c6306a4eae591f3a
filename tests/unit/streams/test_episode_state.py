"""The stream stage's episode state machine, and the processor driving it over a plain dict."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.errors import ContractError, RecordTooLargeError
from rollout_bus.wire.control_records import END_OF_RUN_KEY, Abandoned, EndOfRun
from rollout_bus.wire.episode_record import TURN_FIELDS, decode_episode
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.wire.codec import encode_samples
from rollout_bus.wire.topics import Topics
from rollout_bus.wire.rollout_key import rollout_key_of
from rollout_bus.model.turns import merge_samples
from rollout_bus.streams.episode_state import (Action, EpisodeIndex, decide, finished_index, index_key, share_final_reward,
                                   turn_key)
from rollout_bus.streams.lost_records import FetchedRange
from rollout_bus.streams.processor import TurnProcessor, TurnRecord, position_key
from rollout_bus.streams.state import ChangelogState


def _h(turn: int, attempt: int = 0, final: bool = False) -> TurnHeaders:
    return TurnHeaders(turn=turn, attempt=attempt, final=final, group_size=2, sent_at_ms=5)


OPEN = EpisodeIndex(attempt=1, next_turn=2)
DONE = EpisodeIndex(attempt=1, next_turn=3, finished=True)


@pytest.mark.parametrize("index, headers, action, kind", [
    pytest.param(None, _h(0), Action.STORE, "", id="first-turn-is-stored"),
    pytest.param(None, _h(0, final=True), Action.EMIT, "", id="single-turn-episode-is-emitted"),
    pytest.param(None, _h(1), Action.HOLD, "gap", id="episode-starting-after-turn-0-waits-for-turn-0"),
    pytest.param(OPEN, _h(2, 1), Action.STORE, "", id="next-turn-is-stored"),
    pytest.param(OPEN, _h(2, 1, final=True), Action.EMIT, "", id="final-next-turn-emits"),
    pytest.param(OPEN, _h(1, 1), Action.DUPLICATE, "", id="stored-turn-again-is-a-duplicate"),
    pytest.param(OPEN, _h(3, 1), Action.HOLD, "gap", id="skipping-a-turn-waits-for-it"),
    pytest.param(OPEN, _h(0, 0), Action.SUPERSEDED, "", id="older-attempt-is-superseded"),
    pytest.param(OPEN, _h(0, 2), Action.STORE, "", id="newer-attempt-at-turn-0-restarts"),
    pytest.param(OPEN, _h(1, 2), Action.HOLD, "gap", id="newer-attempt-not-at-turn-0-waits-for-its-turn-0"),
    pytest.param(DONE, _h(2, 1, final=True), Action.DUPLICATE, "", id="redelivered-final-is-a-duplicate"),
    pytest.param(DONE, _h(0, 1), Action.DUPLICATE, "", id="redelivered-early-turn-is-a-duplicate"),
    pytest.param(DONE, _h(3, 1), Action.DLQ, "finished", id="new-turn-after-finish-is-dead-lettered"),
    pytest.param(DONE, _h(0, 2), Action.DLQ, "finished", id="new-attempt-after-finish-is-dead-lettered"),
    pytest.param(DONE, _h(0, 0), Action.SUPERSEDED, "", id="older-attempt-after-finish-is-superseded"),
])
def test_decide_gives_each_turn_its_fate(index, headers, action, kind):
    decision = decide(index, headers)
    assert decision.action is action
    assert decision.kind == kind
    if action in (Action.STORE, Action.EMIT):
        assert decision.index == EpisodeIndex(headers.attempt, headers.turn + 1, False, headers.group_size)
    if action is Action.DLQ:
        assert decision.reason


def test_a_newer_attempt_names_the_older_attempts_turns_to_discard():
    decision = decide(OPEN, _h(0, 2))
    assert (decision.discard_attempt, decision.discard_turns) == (1, 2)
    assert decide(None, _h(0)).discard_attempt is None


def test_finished_marker_keeps_attempt_and_last_turn():
    marker = finished_index(EpisodeIndex(3, 4, False, 8))
    assert marker == EpisodeIndex(3, 4, True, 8)


def test_episode_index_round_trips_and_rejects_garbage():
    index = EpisodeIndex(2, 5, True, 4)
    assert EpisodeIndex.from_bytes(index.to_bytes()) == index
    for bad in (b"", b"[1,2]", b'[1,2,3,"4"]', b"[1,2,2,4]", b"[-1,0,0,1]"):
        with pytest.raises(ContractError):
            EpisodeIndex.from_bytes(bad)


def test_state_keys_of_different_turns_attempts_and_episodes_differ():
    keys = {turn_key(k, a, t) for k in (b"x", b"y") for a in range(3) for t in range(3)}
    keys |= {index_key(b"x"), index_key(b"y")}
    assert len(keys) == 20


def test_every_sibling_gets_the_final_turns_reward_and_raw_reward():
    segments = [Sample(rollout_id=1, reward=0.1, metadata={"raw_reward": 0.1}), Sample(rollout_id=1, reward=0.7)]
    final = Sample(rollout_id=1, reward=0.9, metadata={"raw_reward": 2.0})
    share_final_reward(segments, final)
    assert [s.reward for s in segments] == [0.9, 0.9]
    assert [s.metadata["raw_reward"] for s in segments] == [2.0, 2.0]


# --- the processor over a dict table -------------------------------------------------------------


def _turn(rollout_id: int, prompt_len: int, prev: Sample | None, new: int, *, reward=None, compact=False,
          rng=np.random.default_rng(0)) -> Sample:
    """The next turn of an episode: prev's tokens + an observation + ``new`` response tokens."""
    if prev is None or compact:
        context = list(rng.integers(1, 50, prompt_len))
    else:
        context = list(prev.tokens) + list(rng.integers(1, 50, 2))
    response = list(rng.integers(1, 50, new))
    mask = RolloutSamplingMask.from_mask_list([[t, 99] for t in response])
    return Sample(group_index=0, index=rollout_id, rollout_id=rollout_id, tokens=context + response,
                  response_length=new, loss_mask=[1] * new, rollout_log_probs=list(rng.random(new) * -1),
                  rollout_sampling_mask=mask, status=Status.COMPLETED, reward=reward, adapter=AdapterRef("a", 1))


def _episode(rollout_id: int, turns: int, compact_at: int | None = None) -> list[Sample]:
    samples, prev = [], None
    for t in range(turns):
        prev = _turn(rollout_id, 4, prev, 3, reward=float(t), compact=(t == compact_at))
        samples.append(prev)
    return samples


class _Sink:
    """Records what the processor sends; ``refuse_over`` bytes raises RecordTooLargeError as a producer would
    (``at_delivery``: from the delivery future instead, as a broker's refusal arrives)."""

    def __init__(self, refuse_over: int | None = None, at_delivery: bool = False):
        self.sent: list[tuple[str, bytes, bytes, list]] = []
        self.partitions: list[int | None] = []
        self.refuse_over, self.at_delivery = refuse_over, at_delivery

    async def __call__(self, topic, key, value, headers, *, wait, partition=None):
        if self.refuse_over is not None and value is not None and len(value) > self.refuse_over:
            error = RecordTooLargeError(f"{len(value)} bytes > {self.refuse_over}")
            if not self.at_delivery or wait:
                raise error
            future = asyncio.get_running_loop().create_future()
            future.set_exception(error)
            return future
        self.sent.append((topic, key, value, headers))
        self.partitions.append(partition)

    def on(self, topic):
        return [s for s in self.sent if s[0] == topic]


def _records(samples: list[Sample], *, attempt: int = 0, partition: int = 0, start_offset: int = 0,
             ts_ms: int = 1_000) -> list[TurnRecord]:
    out = []
    for t, sample in enumerate(samples):
        headers = TurnHeaders(t, attempt, t == len(samples) - 1, 2, 7).to_kafka()
        key = rollout_key_of(sample).encode()
        out.append(TurnRecord(key, encode_samples([sample], TURN_FIELDS), headers, "turns", partition,
                              start_offset + t, ts_ms + t))
    return out


def _run(processor: TurnProcessor, records: list[TurnRecord]) -> None:
    async def go():
        for record in records:
            await processor.handle(record)
        await processor.drain_idle()  # what the app's timer does once the records stop
    asyncio.run(go())


def _processor(store=None, sink=None, **options):
    sink = sink or _Sink()
    topics = Topics(prefix="u.")
    state = ChangelogState({} if store is None else store)
    return TurnProcessor(state, sink, topics, window_ms=60_000, grace_ms=0, **options), sink, topics


def test_processor_emits_the_merge_of_an_episodes_turns_with_one_reward():
    processor, sink, topics = _processor()
    turns = _episode(1, 3, compact_at=2)
    _run(processor, _records(turns))
    (topic, key, value, _), = sink.on(topics.episodes)
    segments, info = decode_episode(value)
    expected = share_final_reward(merge_samples(turns), turns[-1])
    assert len(segments) == 2 and segments == expected
    assert {s.reward for s in segments} == {2.0}
    assert (info.attempt, info.turns, info.event_time_ms) == (0, 3, 1_002)


def test_processor_state_after_an_episode_is_only_its_finished_marker_and_window():
    processor, sink, topics = _processor()
    records = _records(_episode(1, 3))
    _run(processor, records)
    assert sorted(k[:2] for k in processor.table.store) == [b"e|", b"o|", b"w|"]
    assert EpisodeIndex.from_bytes(processor.table[index_key(records[0].key)]).finished


def test_processor_keeps_a_final_in_flight_until_drained_and_its_position_before_it():
    processor, sink, topics = _processor()
    records = _records(_episode(1, 3))

    async def go():
        for record in records:
            await processor.handle(record)
        in_flight = (EpisodeIndex.from_bytes(processor.table[index_key(records[0].key)]).finished,
                     int(processor.table[position_key(0)]))
        await processor.drain()
        return in_flight

    finished_before, position_before = asyncio.run(go())
    assert len(sink.on(topics.episodes)) == 1
    assert not finished_before and position_before == records[-1].offset  # a crash now replays the final
    assert EpisodeIndex.from_bytes(processor.table[index_key(records[0].key)]).finished
    assert int(processor.table[position_key(0)]) == records[-1].offset + 1


def test_processor_ignores_a_redelivered_final_and_dead_letters_a_late_turn():
    processor, sink, topics = _processor()
    records = _records(_episode(1, 2))
    resent = _records(_episode(1, 2), start_offset=1)[1]  # the producer sent the final twice
    late = _records(_episode(1, 3), start_offset=1)[2]
    _run(processor, records + [resent, late])
    assert len(sink.on(topics.episodes)) == 1
    (_, key, value, headers), = sink.on(topics.dlq)
    letter = DeadLetter.from_record(key, value, headers)
    assert (letter.kind, letter.stage, letter.source) == ("finished", "stream", "turns:0:3")
    assert processor.outcomes["duplicates_ignored"] == 1 and processor.outcomes["dlq.finished"] == 1


def test_processor_dead_letters_undecodable_and_unkeyed_records_and_keeps_going():
    processor, sink, topics = _processor()
    good = _records(_episode(2, 1), start_offset=3)
    broken = TurnRecord(good[0].key, b"not safetensors", good[0].headers, "turns", 0, 0, 1)
    unkeyed = TurnRecord(None, good[0].value, good[0].headers, "turns", 0, 1, 1)
    no_headers = TurnRecord(good[0].key, good[0].value, [], "turns", 0, 2, 1)
    _run(processor, [broken, unkeyed, no_headers] + good)
    kinds = [DeadLetter.from_record(k, v, h).kind for _, k, v, h in sink.on(topics.dlq)]
    assert kinds == ["decode", "key", "headers"]
    assert len(sink.on(topics.episodes)) == 1


def test_processor_discards_an_older_attempt_when_a_retry_starts():
    processor, sink, topics = _processor()
    old = _records(_episode(3, 2)[:1], attempt=0)
    old[0] = TurnRecord(old[0].key, old[0].value, TurnHeaders(0, 0, False, 2, 7).to_kafka(), "turns", 0, 0, 1)
    retry = _records(_episode(3, 2), attempt=1, start_offset=1)
    _run(processor, old + retry)
    (_, _, value, headers), = sink.on(topics.episodes)
    assert decode_episode(value)[1].attempt == 1
    assert processor.outcomes["superseded_attempts"] == 1
    assert not any(k.startswith(b"t|") for k in processor.table)


def test_processor_writes_each_turn_payload_to_the_changelog_once():
    """Changelog bytes grow linearly: per turn, one payload plus a constant-size index entry."""
    processor, _, _ = _processor()
    records = _records(_episode(4, 12))
    _run(processor, records)
    payload = sum(len(r.value) + len(r.key) for r in records)
    assert processor.table.changelog_bytes < 1.2 * payload + 2_000


def test_state_queues_writes_and_tombstones_in_order_until_flushed():
    published = []

    async def publish(partition, records):
        published.append((partition, records))

    state = ChangelogState({}, publish)
    state.bind(3)
    state[b"a"] = b"1"
    state.bind(1)
    state[b"c"] = b"3"
    state.bind(3)
    state[b"b"] = b"2"
    del state[b"a"]
    assert published == [] and dict(state.store) == {b"b": b"2", b"c": b"3"}
    asyncio.run(state.flush())
    # one call per partition, each partition's records in write order (partitions are independent logs)
    assert published == [(3, [(b"a", b"1"), (b"b", b"2"), (b"a", None)]), (1, [(b"c", b"3")])]
    asyncio.run(state.flush())
    assert len(published) == 2  # nothing queued: nothing published


def test_processor_does_not_count_a_replayed_final_twice_in_its_window():
    processor, sink, topics = _processor()
    records = _records(_episode(5, 2))
    _run(processor, records)
    processor.table[index_key(records[0].key)] = EpisodeIndex(0, 1).to_bytes()  # finished marker lost in a crash
    processor.table[turn_key(records[0].key, 0, 0)] = b"\0" * 16 + records[0].value
    processor.table[position_key(0)] = b"1"  # ... and so was the position after the final
    processor.forget_partitions()  # and the worker's memory (a restart)
    _run(processor, records[1:])
    assert len(sink.on(topics.episodes)) == 2  # re-emitted: at least once
    latest = json.loads(sink.on(topics.metrics)[-1][2])
    assert latest["episodes"] == 1 and processor.outcomes["window_replays_skipped"] == 1


def test_processor_dead_letters_every_turn_of_an_episode_that_cannot_merge():
    processor, sink, topics = _processor()
    turns = _episode(6, 2)
    turns[1].label = "other"  # identity differs between turns: merge_samples refuses
    _run(processor, _records(turns))
    letters = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert [(d.kind, d.source) for d in letters] == [("merge", "turns:0:0"), ("merge", "turns:0:1")]
    assert decode_samples(letters[0].value, TURN_FIELDS)[0][0] == turns[0]
    (_, key, value, headers), = sink.on(topics.episodes)  # no episode: an abandoned record says why
    assert control_kind(headers) == "abandoned" and key == _records(turns)[0].key
    assert Abandoned.from_value(value).kind == "merge" and Abandoned.from_value(value).source == "turns:0:1"


def test_processor_skips_records_below_its_recorded_position():
    processor, sink, topics = _processor()
    records = _records(_episode(7, 2))
    _run(processor, records + records)  # a replay from an older committed offset
    assert len(sink.on(topics.episodes)) == 1
    assert processor.outcomes["replays_skipped"] == 2 and processor.outcomes["turns_received"] == 2


def test_processor_reads_back_records_its_partition_skipped_and_processes_them_in_order():
    fetched = []
    records = _records(_episode(8, 3))

    async def fetch(topic, partition, start, end):
        fetched.append((topic, partition, start, end))
        return FetchedRange(records[start:end])

    processor, sink, topics = _processor()
    processor.fetch = fetch
    _run(processor, [records[0], records[2]])  # record 1 was acknowledged by Faust but never delivered
    assert fetched == [("turns", 0, 1, 2)]
    assert processor.outcomes["records_caught_up"] == 1 and processor.outcomes["turns_received"] == 3
    (_, _, value, _), = sink.on(topics.episodes)
    assert decode_episode(value)[1].turns == 3 and sink.on(topics.dlq) == []


def test_an_idle_partition_behind_its_end_reads_the_undelivered_records():
    records = _records(_episode(9, 3))

    async def fetch(topic, partition, start, end):
        return FetchedRange(records[start:end])

    processor, sink, topics = _processor()
    processor.fetch = fetch
    _run(processor, records[:1])  # Faust acknowledged records 1 and 2 but never delivered them
    asyncio.run(processor.catch_up_idle("turns", {0: 1}, idle_s=0.0))
    assert sink.on(topics.episodes) == []  # nothing missing yet
    asyncio.run(processor.catch_up_idle("turns", {0: 3}, idle_s=3600.0))
    assert sink.on(topics.episodes) == []  # not idle long enough
    asyncio.run(processor.catch_up_idle("turns", {0: 3}, idle_s=0.0))
    (_, _, value, _), = sink.on(topics.episodes)
    assert decode_episode(value)[1].turns == 3 and processor.outcomes["records_caught_up"] == 2


def _abandoned(sink, topics):
    return [(key, Abandoned.from_value(value)) for _, key, value, headers in sink.on(topics.episodes)
            if control_kind(headers) == "abandoned"]


def test_a_dead_lettered_final_turn_abandons_its_episode_and_dead_letters_what_was_stored():
    processor, sink, topics = _processor()
    records = _records(_episode(10, 3))
    broken = TurnRecord(records[2].key, b"not a payload", records[2].headers, "turns", 0, 2, 1_002)
    _run(processor, records[:2] + [broken, broken])  # the broken final, then a redelivery of it
    (key, marker), = _abandoned(sink, topics)
    assert key == records[0].key and (marker.kind, marker.attempt, marker.group_size) == ("decode", 0, 2)
    letters = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert sorted((d.kind, d.source) for d in letters) == [("abandoned", "turns:0:0"), ("abandoned", "turns:0:1"),
                                                           ("decode", "turns:0:2")]
    assert not any(k.startswith(b"t|") for k in processor.table)  # nothing of it stays in the state
    assert EpisodeIndex.from_bytes(processor.table[index_key(key)]).finished
    assert processor.outcomes["replays_skipped"] == 1  # the redelivery changed nothing


def test_a_final_turn_that_skips_a_turn_abandons_the_episode_but_a_dead_lettered_middle_turn_does_not():
    processor, sink, topics = _processor()
    records = _records(_episode(11, 3))
    broken_middle = TurnRecord(records[1].key, b"garbage", records[1].headers, "turns", 0, 1, 1_001)
    _run(processor, [records[0], broken_middle])
    assert _abandoned(sink, topics) == []
    _run(processor, [records[2]])  # turn 2 final, turn 1 never stored: a gap, and the end of the episode
    (_, marker), = _abandoned(sink, topics)
    assert marker.kind == "gap"


def test_a_final_turn_with_a_key_that_names_no_group_is_dead_lettered_without_an_abandoned_record():
    processor, sink, topics = _processor()
    record = _records(_episode(12, 1))[0]
    _run(processor, [TurnRecord(b"no-group", b"x", record.headers, "turns", 0, 0, 1)])
    assert _abandoned(sink, topics) == [] and len(sink.on(topics.dlq)) == 1


@pytest.mark.parametrize("at_delivery", [False, True], ids=["refused-by-the-producer", "refused-by-the-broker"])
def test_an_episode_over_the_size_limit_is_dead_lettered_by_reference_and_abandoned(at_delivery):
    records = _records(_episode(13, 3))
    limit = max(len(r.value) for r in records) + 100  # every turn fits; the merged episode does not
    processor, sink, topics = _processor(sink=_Sink(refuse_over=limit, at_delivery=at_delivery))
    _run(processor, records)
    (letter,) = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert (letter.kind, letter.value, letter.source) == ("too_large", None, "turns:0:2")
    assert "offsets [0, 1, 2]" in letter.reason
    (_, marker), = _abandoned(sink, topics)
    assert marker.kind == "too_large" and processor.outcomes["episodes_too_large"] == 1
    assert processor.outcomes["episodes_emitted"] == 0 and not any(k.startswith(b"t|") for k in processor.table)


def test_a_dead_letter_too_large_to_copy_goes_by_reference():
    record = _records(_episode(14, 1))[0]
    broken = TurnRecord(record.key, b"\0" * 5_000, record.headers, "turns", 0, 0, 1)
    processor, sink, topics = _processor(sink=_Sink(refuse_over=1_000))
    _run(processor, [broken])
    (letter,) = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert letter.kind == "too_large" and letter.value is None and "5000 bytes" in letter.reason
    assert "decode" in letter.reason


def test_end_of_run_is_forwarded_to_every_episode_partition_after_the_partitions_episodes():
    processor, sink, topics = _processor(turns_partitions=3, episodes_partitions=2)
    records = _records(_episode(15, 2), partition=1)
    marker = TurnRecord(END_OF_RUN_KEY, EndOfRun("run-a").value(), EndOfRun("run-a").headers(), "turns", 1, 2, 5)

    async def go():
        for record in records + [marker]:
            await processor.handle(record)  # no drain in between: the final is still in flight
    asyncio.run(go())
    on_episodes = [(key, headers, part) for (topic, key, _, headers), part in zip(sink.sent, sink.partitions)
                   if topic == topics.episodes]
    assert [control_kind(h) for _, h, _ in on_episodes] == [None, "end-of-run", "end-of-run"]
    assert [part for _, _, part in on_episodes[1:]] == [0, 1]
    forwarded = EndOfRun.from_value([v for t, k, v, _ in sink.sent if k == END_OF_RUN_KEY][0])
    assert forwarded == EndOfRun("run-a", 1, 3)
    assert int(processor.table[position_key(1)]) == 3


def test_a_malformed_control_record_is_dead_lettered():
    processor, sink, topics = _processor()
    _run(processor, [TurnRecord(END_OF_RUN_KEY, b"{}", EndOfRun("r").headers(), "turns", 0, 0, 1),
                     TurnRecord(b"k", b"", [("control", b"pause")], "turns", 0, 1, 1)])
    kinds = [DeadLetter.from_record(k, v, h).kind for _, k, v, h in sink.on(topics.dlq)]
    assert kinds == ["control", "control"] and sink.on(topics.episodes) == []


def test_finished_markers_are_pruned_behind_the_position_and_a_later_duplicate_is_emitted_again_with_its_attempt():
    processor, sink, topics = _processor(finished_retention=4)
    first = _records(_episode(16, 2))
    later = [_records(_episode(17 + i, 1), start_offset=2 + i)[0] for i in range(4)]
    _run(processor, first + later[:2])
    assert index_key(first[0].key) in processor.table  # within the retention
    _run(processor, later[2:])
    assert index_key(first[0].key) not in processor.table and processor.outcomes["finished_markers_pruned"] == 1
    again = _records(_episode(16, 2), start_offset=6)  # a producer publishes the episode again
    _run(processor, again)
    emitted = [(k, decode_episode(v)[1].attempt) for _, k, v, h in sink.on(topics.episodes)]
    assert emitted.count((first[0].key, 0)) == 2  # the same (key, attempt): the shard writer drops it


def test_pruning_resumes_from_the_table_after_a_reassignment():
    processor, sink, topics = _processor(finished_retention=2)
    _run(processor, _records(_episode(30, 1)) + _records(_episode(31, 1), start_offset=1))
    processor.forget_partitions()  # a rebalance: the order is rebuilt from the markers in the table
    _run(processor, _records(_episode(32, 1), start_offset=2) + _records(_episode(33, 1), start_offset=3))
    assert processor.outcomes["finished_markers_pruned"] == 2


def _lost_letters(sink, topics):
    letters = [DeadLetter.from_record(key, value, headers) for _, key, value, headers in sink.on(topics.dlq)]
    return [(letter.kind, letter.source, letter.lost, letter.key, letter.value) for letter in letters]


def test_records_deleted_before_they_were_read_are_dead_lettered_as_lost_and_the_position_moves_past_them():
    records = _records(_episode(3, 2)) + _records(_episode(4, 2), start_offset=2)
    fetches = []

    async def fetch(topic, partition, start, end):  # retention deleted offsets 1..2: the log now starts at 3
        fetches.append((start, end))
        return FetchedRange([r for r in records[start:end] if r.offset >= 3], log_start=3)

    processor, sink, topics = _processor(fetch=fetch)
    _run(processor, [records[0], records[3]])  # Faust's consumer reset to the log start without a word
    assert fetches == [(1, 3)]
    lost, = _lost_letters(sink, topics)  # episode 4's turn 0 was lost: its turn 1 waits (a gap at the run's end)
    assert lost == ("lost", "turns:0:1", 2, b"", None) and processor.outcomes["turns_held"] == 1
    assert processor.outcomes["records_lost"] == 2 and processor.outcomes["dlq.lost"] == 1
    assert int(processor.table[position_key(0)]) == 4
    # the idle timer finds nothing more to read: the lost offsets are not awaited again
    asyncio.run(processor.catch_up_idle("turns", {0: 4}, idle_s=0.0))
    assert fetches == [(1, 3)] and processor.outcomes["records_lost"] == 2


def test_a_partition_whose_every_unread_record_expired_is_reported_once_and_never_read_again():
    async def fetch(topic, partition, start, end):
        return FetchedRange([], log_start=end)

    processor, sink, topics = _processor(store={position_key(0): b"12"}, fetch=fetch)
    asyncio.run(processor.catch_up_idle("turns", {0: 88}, idle_s=0.0))
    asyncio.run(processor.catch_up_idle("turns", {0: 88}, idle_s=0.0))
    assert _lost_letters(sink, topics) == [("lost", "turns:0:12", 76, b"", None)]
    assert int(processor.table[position_key(0)]) == 88


def test_a_live_worker_whose_first_record_is_past_offset_0_reads_from_0_and_a_replay_does_not():
    records = _records(_episode(5, 2), start_offset=5)

    async def fetch(topic, partition, start, end):  # offsets 0..4 expired before any worker read them
        return FetchedRange([], log_start=5)

    live, sink, topics = _processor(fetch=fetch, reads_from_start=True)
    _run(live, records)
    assert _lost_letters(sink, topics) == [("lost", "turns:0:0", 5, b"", None)]
    assert len(sink.on(topics.episodes)) == 1
    replay, sink, topics = _processor(fetch=fetch)
    _run(replay, records)
    assert sink.on(topics.dlq) == [] and len(sink.on(topics.episodes)) == 1


def test_a_rebalance_pause_waits_for_the_record_in_hand_applies_its_final_and_holds_records_until_resume():
    records = _records(_episode(1, 3))
    fetched = asyncio.Event()
    release = asyncio.Event()

    async def slow_fetch(topic, partition, start, end):  # a catch-up read still under way when the rebalance begins
        fetched.set()
        await release.wait()
        return FetchedRange(records[start:end])

    processor, sink, topics = _processor(store={position_key(0): b"0"}, fetch=slow_fetch)
    late = _records(_episode(2, 1), start_offset=3)[0]

    async def go():
        in_hand = asyncio.create_task(processor.handle(records[2]))  # offsets 0-1 were skipped: read back first
        await fetched.wait()
        pause = asyncio.create_task(processor.pause())
        await asyncio.sleep(0)
        paused_early = pause.done()
        release.set()
        await asyncio.gather(in_hand, pause)
        state_at_pause = (EpisodeIndex.from_bytes(processor.table[index_key(records[0].key)]).finished,
                          int(processor.table[position_key(0)]))
        held = asyncio.create_task(processor.handle(late))
        idle = asyncio.create_task(processor.drain_idle())
        for _ in range(5):
            await asyncio.sleep(0)
        held_while_paused = (held.done(), idle.done(), len(sink.on(topics.episodes)))
        processor.resume()
        await asyncio.gather(held, idle)
        await processor.drain()
        return paused_early, state_at_pause, held_while_paused

    paused_early, state_at_pause, held_while_paused = asyncio.run(asyncio.wait_for(go(), 30))
    assert not paused_early  # the pause waited for the record in hand
    assert state_at_pause == (True, 3)  # its final was acknowledged and applied, its position recorded
    assert held_while_paused == (False, False, 1)  # nothing touched the state until resume()
    assert len(sink.on(topics.episodes)) == 2 and int(processor.table[position_key(0)]) == 4


def _from_generator(records: list[TurnRecord], generator: str, first_offset: int) -> list[TurnRecord]:
    """The same turns as another generator's records (its ``generator`` header), at later offsets."""
    out = []
    for i, record in enumerate(records):
        headers = TurnHeaders.from_kafka(record.headers)
        stamped = TurnHeaders(headers.turn, headers.attempt, headers.final, headers.group_size, headers.sent_at_ms,
                              generator=generator).to_kafka()
        out.append(TurnRecord(record.key, record.value, stamped, record.topic, record.partition, first_offset + i,
                              record.timestamp_ms))
    return out


def test_a_turn_for_an_episode_another_generator_made_is_dead_lettered_as_a_collision_never_merged():
    turns = _episode(6, 2)
    first = _from_generator(_records(turns), "g0of1-seed1", 0)
    second = _from_generator(_records(turns), "g0of1-seed2", 2)  # same key: another seed, same group index
    processor, sink, topics = _processor()
    arriving = [first[0], second[0], second[1], first[1], *_from_generator(_records(turns), "g0of1-seed2", 4)]
    arriving = [TurnRecord(r.key, r.value, r.headers, r.topic, r.partition, offset, r.timestamp_ms)
                for offset, r in enumerate(arriving)]  # one partition, in this order
    _run(processor, arriving)
    episodes = [r for r in sink.on(topics.episodes) if control_kind(r[3]) is None]
    assert len(episodes) == 1 and decode_episode(episodes[0][2])[1].turns == 2  # the first generator's, whole
    letters = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert [(d.kind, d.source) for d in letters] == [("collision", "turns:0:1"), ("collision", "turns:0:2"),
                                                     ("collision", "turns:0:4"), ("collision", "turns:0:5")]
    assert "generator 'g0of1-seed1' already made this episode" in letters[0].reason
    assert "--generators N --generator-index I" in letters[0].reason
    assert not [r for r in sink.on(topics.episodes) if control_kind(r[3]) == "abandoned"]  # nothing abandoned
    assert processor.outcomes["dlq.collision"] == 4


def test_the_same_generator_restarted_and_a_generator_without_the_header_are_not_collisions():
    turns = _episode(7, 2)
    same = _from_generator(_records(turns), "g1of2-seed3", 0) + _from_generator(_records(turns), "g1of2-seed3", 2)
    processor, sink, topics = _processor()
    _run(processor, same)  # a restart re-publishing its episode: duplicates, dropped as such
    assert len(sink.on(topics.episodes)) == 1 and sink.on(topics.dlq) == []
    unnamed = _records(_episode(8, 2))
    mixed = [unnamed[0], _from_generator(unnamed, "g0of1-seed0", 0)[1]]
    processor, sink, topics = _processor()
    _run(processor, mixed)
    assert len(sink.on(topics.episodes)) == 1 and sink.on(topics.dlq) == []


def test_the_episode_index_keeps_its_generator_and_reads_older_indexes_without_one():
    index = EpisodeIndex(1, 3, True, 4, 2, 99, "g0of2-seed7")
    assert EpisodeIndex.from_bytes(index.to_bytes()) == index
    assert EpisodeIndex.from_bytes(b"[1,3,0,4]") == EpisodeIndex(1, 3, False, 4)
    assert finished_index(EpisodeIndex(0, 2, False, 4, generator="x"), 1, 5).generator == "x"
    with pytest.raises(ContractError):
        EpisodeIndex.from_bytes(b'[1,3,0,"g"]')


def test_a_generator_header_that_is_not_an_id_is_refused_by_name():
    headers = TurnHeaders(0, 0, False, 2, 7).to_kafka() + [("generator", b"two words")]
    with pytest.raises(ContractError, match=r"header 'generator' must be 1-128 of ASCII letters.*'two words'"):
        TurnHeaders.from_kafka(headers)
    assert TurnHeaders.from_kafka(TurnHeaders(0, 0, False, 2, 7, generator="g0of1-seed0").to_kafka()).generator \
        == "g0of1-seed0"


def _in_order(records: list[TurnRecord]) -> list[TurnRecord]:
    """The records at consecutive offsets of one partition, in the order given (as they arrived)."""
    return [TurnRecord(r.key, r.value, r.headers, r.topic, r.partition, offset, r.timestamp_ms)
            for offset, r in enumerate(records)]


@pytest.mark.parametrize("order", [(0, 2, 1), (1, 0, 2), (2, 1, 0), (1, 2, 0)])
def test_turns_that_arrive_before_their_predecessor_wait_for_it_and_the_episode_merges_whole(order):
    turns = _episode(14, 3)
    records = _records(turns)
    processor, sink, topics = _processor()
    _run(processor, _in_order([records[i] for i in order]))
    (_, _, value, _), = sink.on(topics.episodes)
    segments, info = decode_episode(value)
    assert info.turns == 3 and segments == share_final_reward(merge_samples(turns), turns[-1])
    assert sink.on(topics.dlq) == [] and processor.outcomes["turns_received"] == 3
    assert processor.outcomes["turns_held"] == processor.outcomes["turns_released"] >= 1
    assert not any(k.startswith(b"h|") for k in processor.table)  # nothing left held


def test_a_turn_still_waiting_when_the_run_ends_on_its_partition_is_a_gap_and_a_final_one_abandons():
    records = _records(_episode(15, 3))
    end = TurnRecord(END_OF_RUN_KEY, EndOfRun("run-b").value(), EndOfRun("run-b").headers(), "turns", 0, 0, 9)
    processor, sink, topics = _processor()
    _run(processor, _in_order([records[0], records[2], end]))  # turn 1 never comes
    letters = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    gap = next(d for d in letters if d.kind == "gap")
    assert gap.source == "turns:0:1" and "the run ended on this partition before it came" in gap.reason
    (_, marker), = _abandoned(sink, topics)
    assert marker.kind == "gap" and not any(k.startswith(b"h|") for k in processor.table)
    assert [k for _, k, _, _ in sink.on(topics.episodes)][-1] == END_OF_RUN_KEY  # forwarded after the gap


def test_a_held_turn_survives_a_restart_in_the_state_and_merges_when_its_predecessor_comes():
    turns = _episode(16, 3)
    records = _in_order([_records(turns)[i] for i in (0, 2, 1)])
    store: dict = {}
    first, _, _ = _processor(store=store)
    _run(first, records[:2])  # turn 2 held; the worker then stops
    again, sink, topics = _processor(store=store)  # a new worker over the same state
    _run(again, records[2:])
    (_, _, value, _), = sink.on(topics.episodes)
    assert decode_episode(value)[1].turns == 3 and sink.on(topics.dlq) == []
