"""The run's end settles every episode left without its final turn: the turns a dead generator stored are
dead-lettered ``unfinished`` naming the key, the turns and the generator, the group is told the episode will
never come (``abandoned``), a WARNING line says so, nothing of it stays in the state, and all of it happens
before the end-of-run marker is forwarded."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollout_bus.streams.episode_state import EpisodeIndex, index_key
from rollout_bus.streams.processor import TurnRecord
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.partitioning import partition_for
from tests.unit.streams.test_episode_state import _abandoned, _episode, _processor, _records, _run


def _turns(rollout_id: int, turns: int, *, partition: int = 0, start_offset: int = 0,
           generator: str | None = "gen-7") -> list[TurnRecord]:
    """The first ``turns`` turns of a 3-turn episode (no final turn when ``turns`` < 3), with a generator header."""
    records = _records(_episode(rollout_id, 3), partition=partition, start_offset=start_offset)[:turns]
    out = []
    for t, r in enumerate(records):
        headers = TurnHeaders(t, 0, t == 2, 2, 7, generator=generator).to_kafka()
        out.append(TurnRecord(r.key, r.value, headers, r.topic, r.partition, r.offset, r.timestamp_ms))
    return out


def _end(partition: int, offset: int) -> TurnRecord:
    marker = EndOfRun("run-u")
    return TurnRecord(END_OF_RUN_KEY, marker.value(), marker.headers(), "turns", partition, offset, 9_000)


def _state_of(processor, key: bytes) -> list[bytes]:
    return [k for k in processor.table if k.endswith(key)]


def test_an_episode_without_its_final_turn_is_dead_lettered_abandoned_and_forgotten_before_the_marker_goes(caplog):
    processor, sink, topics = _processor()
    stored = _turns(20, 2)
    caplog.set_level(logging.WARNING, logger="rollout_bus.streams")
    _run(processor, stored + [_end(0, 2)])
    key = stored[0].key
    letters = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert [(d.kind, d.stage, d.source, d.key) for d in letters] == [("unfinished", "stream", "turns:0:0", key),
                                                                   ("unfinished", "stream", "turns:0:1", key)]
    assert [d.value for d in letters] == [r.value for r in stored]  # the turns themselves, byte for byte
    reason = letters[0].reason
    assert key.decode() in reason and "turns 0..1 of 2" in reason and "[0, 1]" in reason
    assert "generator 'gen-7'" in reason and "turns:0:2" in reason
    assert TurnHeaders.from_kafka(letters[1].headers) == TurnHeaders(1, 0, False, 2, 7, generator="gen-7")
    (abandoned_key, marker), = _abandoned(sink, topics)
    assert abandoned_key == key and (marker.kind, marker.attempt, marker.group_size) == ("unfinished", 0, 2)
    assert marker.source == "turns:0:2"
    assert _state_of(processor, key) == []  # no index, no stored turn: nothing of it stays
    kinds = [(t, control_kind(h)) for t, _, _, h in sink.sent if t != topics.metrics]
    assert kinds == [(topics.dlq, None), (topics.dlq, None), (topics.episodes, "abandoned"),
                     (topics.episodes, "end-of-run")]  # settled, then forwarded
    assert processor.outcomes["episodes_unfinished"] == 1 and processor.outcomes["dlq.unfinished"] == 2
    assert any(r.levelno == logging.WARNING and "UNFINISHED" in r.getMessage() and "gen-7" in r.getMessage()
               for r in caplog.records)


def test_finished_episodes_and_one_whose_final_is_still_in_flight_are_left_alone():
    processor, sink, topics = _processor()
    done = _turns(21, 3)
    in_flight = _turns(22, 3, start_offset=3)
    _run(processor, done)

    async def go():
        for record in in_flight + [_end(0, 6)]:
            await processor.handle(record)  # no drain before the marker: the final is in flight
    asyncio.run(go())
    assert sink.on(topics.dlq) == [] and _abandoned(sink, topics) == []
    assert [control_kind(h) for _, _, _, h in sink.on(topics.episodes)] == [None, None, "end-of-run"]
    assert EpisodeIndex.from_bytes(processor.table[index_key(in_flight[0].key)]).finished


def test_without_a_generator_header_the_reason_says_so_and_a_dead_turn_mark_is_removed_too():
    processor, sink, topics = _processor()
    first, second = _turns(23, 2, generator=None)
    broken = TurnRecord(second.key, b"garbage", second.headers, "turns", 0, 1, second.timestamp_ms)
    _run(processor, [first, broken, _end(0, 2)])  # turn 1 dead-lettered for itself, turn 2 never came
    letters = [DeadLetter.from_record(k, v, h) for _, k, v, h in sink.on(topics.dlq)]
    assert [d.kind for d in letters] == ["decode", "unfinished"]
    assert "a generator that sent no generator header" in letters[1].reason
    assert _state_of(processor, first.key) == []  # the dead-turn mark (x|) went with the rest


def _key_on(partition: int, partitions: int, start: int) -> int:
    """A rollout id (from ``start``) whose key murmur2 puts on ``partition``."""
    return next(i for i in range(start, start + 200)
                if partition_for(_records(_episode(i, 1))[0].key, partitions) == partition)


def test_only_the_episodes_of_the_markers_partition_are_settled():
    processor, sink, topics = _processor(turns_partitions=2)
    mine, other = _key_on(0, 2, 30), _key_on(1, 2, 30)
    on_0, on_1 = _turns(mine, 2, partition=0), _turns(other, 2, partition=1)
    _run(processor, on_0 + on_1 + [_end(0, 2)])
    assert {DeadLetter.from_record(k, v, h).key for _, k, v, h in sink.on(topics.dlq)} == {on_0[0].key}
    assert _state_of(processor, on_0[0].key) == [] and index_key(on_1[0].key) in processor.table
    _run(processor, [_end(1, 2)])
    assert [k for k, _ in _abandoned(sink, topics)] == [on_0[0].key, on_1[0].key]
    assert not any(k.startswith((b"e|", b"t|")) for k in processor.table)


def test_where_one_table_holds_every_partition_the_partition_its_turns_came_from_settles_it():
    processor, sink, topics = _processor(reroute=False)  # an offline replay: one partition count unknown
    on_1 = _turns(40, 2, partition=1)
    _run(processor, on_1 + [_end(0, 0)])
    assert sink.on(topics.dlq) == []  # partition 0's end says nothing of an episode stored from partition 1
    assert EpisodeIndex.from_bytes(processor.table[index_key(on_1[0].key)]).partition == 1
    _run(processor, [_end(1, 2)])
    assert {DeadLetter.from_record(k, v, h).kind for _, k, v, h in sink.on(topics.dlq)} == {"unfinished"}


@pytest.mark.parametrize("index", [EpisodeIndex(1, 2, False, 4, partition=3),
                                   EpisodeIndex(1, 2, False, 4, partition=3, generator="g"),
                                   EpisodeIndex(1, 2, True, 4, partition=3, final_offset=9, generator="g"),
                                   EpisodeIndex(1, 2, False, 4)])
def test_an_open_episodes_index_keeps_its_partition_and_round_trips(index):
    assert EpisodeIndex.from_bytes(index.to_bytes()) == index


def test_a_finished_index_still_needs_its_final_offset():
    with pytest.raises(Exception):
        EpisodeIndex.from_bytes(b"[1,2,1,4,3,-1]")
