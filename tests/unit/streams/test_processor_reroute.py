"""A turn on the wrong rollout.turns partition for its key is re-routed to its key's partition, never merged
(or dead-lettered as a gap) where it landed; a re-sent copy is a duplicate there, not a second turn."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from rollout_bus.wire.partitioning import partition_for
from rollout_bus.wire.episode_record import decode_episode
from rollout_bus.wire.topics import Topics
from rollout_bus.wire.headers import HEADER_REROUTED_FROM
from rollout_bus.streams.processor import TurnProcessor
from rollout_bus.streams.state import ChangelogState
from tests.unit.streams.test_episode_state import _episode, _records, _Sink

PARTITIONS = 4


def _processor(sink: _Sink) -> TurnProcessor:
    return TurnProcessor(ChangelogState({}, None), sink, Topics(prefix="u."), window_ms=60_000, grace_ms=0,
                         turns_partitions=PARTITIONS)


def _placed(rollout_id: int, turns: int) -> tuple[list, int]:
    """An episode's records on its key's own partition, and that partition."""
    records = _records(_episode(rollout_id, turns))
    home = partition_for(records[0].key, PARTITIONS)
    return [replace(r, partition=home) for r in records], home


def test_a_final_turn_on_the_wrong_partition_is_re_routed_not_dead_lettered_as_a_gap():
    sink = _Sink()
    processor = _processor(sink)
    (first, final), home = _placed(7, 2)
    wrong = (home + 1) % PARTITIONS
    asyncio.run(processor.handle_batch([first, replace(final, partition=wrong, offset=40)]))
    assert sink.on("u.rollout.dlq") == [] and sink.on("u.rollout.episodes") == []
    (topic, key, value, headers), = sink.on("turns")
    assert (key, value) == (final.key, final.value) and sink.partitions == [home]
    assert headers == [*final.headers, (HEADER_REROUTED_FROM, f"turns:{wrong}:40".encode())]
    assert processor.outcomes["turns_rerouted"] == 1 and processor.outcomes["turns_stored"] == 1

    # the copy arrives on the key's partition after turn 0: the episode is merged there, once
    copy = replace(final, headers=headers, offset=first.offset + 1)
    asyncio.run(processor.handle_batch([copy, replace(copy, offset=copy.offset + 1)]))  # a crash re-sent it
    (_, _, episode, _), = sink.on("u.rollout.episodes")
    segments, info = decode_episode(episode)
    assert info.turns == 2 and len(segments) == 1 and sink.on("u.rollout.dlq") == []
    assert processor.outcomes["episodes_emitted"] == 1


def test_a_turn_re_routed_once_and_still_misplaced_is_dead_lettered_not_sent_round_again():
    sink = _Sink()
    processor = _processor(sink)
    (only,), home = _placed(8, 1)
    looped = replace(only, partition=(home + 2) % PARTITIONS,
                     headers=[*only.headers, (HEADER_REROUTED_FROM, b"turns:0:3")])
    asyncio.run(processor.handle_batch([looped]))
    assert sink.on("turns") == [] and processor.outcomes["dlq.partition"] == 1
    (_, _, _, headers), = sink.on("u.rollout.dlq")
    reason = dict(headers)["dlq.reason"].decode()
    assert f"partition {home} of {PARTITIONS}" in reason and "murmur2" in reason


def test_a_record_whose_key_is_not_a_rollout_key_is_judged_where_it_is():
    sink = _Sink()
    processor = _processor(sink)
    (only,), home = _placed(9, 1)
    garbage = replace(only, key=b"not-json", partition=(partition_for(b"not-json", PARTITIONS) + 1) % PARTITIONS)
    asyncio.run(processor.handle_batch([garbage]))
    assert sink.on("turns") == [] and processor.outcomes["turns_rerouted"] == 0
    (_, _, _, headers), = sink.on("u.rollout.dlq")
    assert dict(headers)["dlq.source"].decode() == garbage.source
