"""Deliveries of a prompt group in the stream's state machine: a takeover is not a collision, a zombie is fenced."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.streams.episode_state import Action, EpisodeIndex, decide, finished_index, index_key
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.episode_record import EpisodeInfo
from rollout_bus.wire.headers import HEADER_TAKEOVER_TOKENS, TurnHeaders
from tests.wire_schemas import header_object, validate


def _h(turn: int, *, delivery: int, generator: str, attempt: int = 0, final: bool = False) -> TurnHeaders:
    return TurnHeaders(turn=turn, attempt=attempt, final=final, group_size=4, sent_at_ms=5, generator=generator,
                       delivery=delivery)


OPEN_1 = EpisodeIndex(attempt=0, next_turn=2, generator="gen-a", delivery=1)
DONE_1 = finished_index(OPEN_1, 0, 17)


def test_a_higher_delivery_at_turn_0_takes_an_open_episode_over_from_another_generator():
    decision = decide(OPEN_1, _h(0, delivery=2, generator="gen-b"))
    assert decision.action is Action.STORE and decision.takeover
    assert (decision.discard_attempt, decision.discard_turns) == (0, 2)
    assert decision.index.generator == "gen-b" and decision.index.delivery == 2


def test_the_same_delivery_from_another_generator_is_still_a_collision():
    decision = decide(OPEN_1, _h(2, delivery=1, generator="gen-b"))
    assert decision.action is Action.DLQ and decision.kind == DlqKind.COLLISION


@pytest.mark.parametrize("index", [OPEN_1, DONE_1], ids=["open", "finished"])
def test_a_lower_delivery_is_fenced_never_merged(index):
    taken = EpisodeIndex(attempt=0, next_turn=1, generator="gen-b", delivery=2) if not index.finished else \
        finished_index(EpisodeIndex(attempt=0, next_turn=3, generator="gen-b", delivery=2), 0, 30)
    decision = decide(taken, _h(1, delivery=1, generator="gen-a", final=True))
    assert decision.action is Action.FENCED
    assert "delivery 2 took the episode over" in decision.reason and "'gen-a'" in decision.reason


def test_a_higher_delivery_for_a_finished_episode_is_redone_not_dead_lettered():
    decision = decide(DONE_1, _h(0, delivery=2, generator="gen-b"))
    assert decision.action is Action.REDONE and "finished by delivery 1" in decision.reason


def test_a_higher_delivery_past_turn_0_waits_for_its_turn_0():
    assert decide(OPEN_1, _h(1, delivery=2, generator="gen-b")).action is Action.HOLD


def test_the_index_keeps_its_delivery_through_bytes():
    for index in (OPEN_1, DONE_1, EpisodeIndex(3, 1, delivery=5), EpisodeIndex(0, 1)):
        assert EpisodeIndex.from_bytes(index.to_bytes()) == index
    assert EpisodeIndex(0, 1).to_bytes() == b"[0,1,0,1]"  # an index without deliveries is spelled as before


def test_delivery_header_round_trips_and_is_absent_for_planned_groups():
    headers = _h(0, delivery=3, generator="gen-a")
    assert ("delivery", b"3") in headers.to_kafka()
    assert TurnHeaders.from_kafka(headers.to_kafka()) == headers
    planned = TurnHeaders(turn=0, attempt=0, final=False, group_size=1, sent_at_ms=1)
    assert all(name != "delivery" for name, _ in planned.to_kafka())
    assert TurnHeaders.from_kafka(planned.to_kafka()).delivery == 0


def _with_delivery(records, delivery: int, generator: str):
    """The same turn records as made by ``generator`` at ``delivery`` of their prompt group."""
    from rollout_bus.streams.turn_record import TurnRecord

    out = []
    for r in records:
        h = TurnHeaders.from_kafka(r.headers)
        headers = TurnHeaders(h.turn, h.attempt, h.final, h.group_size, h.sent_at_ms, generator=generator,
                              delivery=delivery).to_kafka()
        out.append(TurnRecord(r.key, r.value, headers, r.topic, r.partition, r.offset, r.timestamp_ms))
    return out


def test_the_processor_takes_an_episode_over_counts_what_it_throws_away_and_fences_the_zombie():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    processor, sink, topics = _processor()
    turns = _episode(5, 3)
    dead = _with_delivery(_records(turns), 1, "gen-a")[:2]  # two turns, then its generator died
    taken = _with_delivery(_records(turns, start_offset=2), 2, "gen-b")
    zombie = _with_delivery(_records(turns, start_offset=3), 1, "gen-a")[2:]  # its late final turn
    _run(processor, dead + taken + zombie)
    assert len(sink.on(topics.episodes)) == 1 and not sink.on(topics.dlq)
    counts = processor.outcomes
    assert (counts["taken_over_episodes"], counts["takeover_turns_discarded"], counts["fenced_turns"]) == (1, 2, 1)
    assert counts["takeover_tokens_discarded"] == sum(t.response_length for t in turns[:2])
    assert counts["superseded_attempts"] == 0 and counts["dlq.collision"] == 0


def _takeover_header(headers) -> bytes | None:
    return dict(headers).get(HEADER_TAKEOVER_TOKENS)


def test_the_episode_record_says_the_response_tokens_its_takeover_threw_away():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    processor, sink, topics = _processor()
    turns = _episode(6, 3)
    dead = _with_delivery(_records(turns), 1, "gen-a")[:2]
    taken = _with_delivery(_records(turns, start_offset=2), 2, "gen-b")
    _run(processor, dead + taken)
    (_, _, _, headers), = sink.on(topics.episodes)
    thrown_away = sum(t.response_length for t in turns[:2])
    assert thrown_away > 0 and _takeover_header(headers) == str(thrown_away).encode()
    assert processor.outcomes["takeover_tokens_discarded"] == thrown_away
    assert headers[:4] == EpisodeInfo(0, 3, 2, 7, 0).headers()  # the usual four first, then the count
    validate("episode_headers", header_object(headers))


def test_an_undisturbed_episode_record_has_no_takeover_header_and_its_headers_are_as_before():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    processor, sink, topics = _processor()
    _run(processor, _with_delivery(_records(_episode(7, 3)), 1, "gen-a"))
    (_, _, _, headers), = sink.on(topics.episodes)
    assert [name for name, _ in headers] == ["attempt", "group_size", "schema", "sent_at"]
    assert EpisodeInfo(0, 3, 2, 7, 0).headers(takeover_tokens=0) == EpisodeInfo(0, 3, 2, 7, 0).headers()


def test_the_count_survives_a_restart_and_sums_over_every_takeover_and_a_later_attempt():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    turns = _episode(8, 3)
    store: dict = {}
    first, _, _ = _processor(store=store)
    _run(first, _with_delivery(_records(turns), 1, "gen-a")[:2]  # delivery 1 stores 2 turns, its generator dies
         + _with_delivery(_records(turns, start_offset=2), 2, "gen-b")[:1])  # delivery 2 takes over, stores 1
    index = EpisodeIndex.from_bytes(store[index_key(_records(turns)[0].key)])
    assert index.takeover_tokens == sum(t.response_length for t in turns[:2])
    again, sink, topics = _processor(store=store)  # a new worker over the changelogged state
    _run(again, _with_delivery(_records(turns, start_offset=3), 3, "gen-c")[:1]  # delivery 3 takes over at turn 0
         + _with_delivery(_records(turns, start_offset=4, attempt=1), 3, "gen-c"))  # then retries: attempt 1
    (_, _, _, headers), = sink.on(topics.episodes)
    thrown_away = sum(t.response_length for t in turns[:2]) + turns[0].response_length
    assert _takeover_header(headers) == str(thrown_away).encode()
    assert again.outcomes["takeover_tokens_discarded"] == turns[0].response_length  # this worker's own count
    assert again.outcomes["superseded_attempts"] == 1  # the retry of delivery 3 is no takeover: nothing added
    assert EpisodeIndex.from_bytes(store[index_key(_records(turns)[0].key)]).takeover_tokens == 0  # the marker


def test_a_single_turn_episode_taken_over_by_its_final_turn_carries_the_count():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    processor, sink, topics = _processor()
    turns = _episode(9, 2)
    dead = _with_delivery(_records(turns), 1, "gen-a")[:1]
    final = _with_delivery(_records(turns[-1:], start_offset=1), 2, "gen-b")  # turn 0, final, of delivery 2
    _run(processor, dead + final)
    (_, _, _, headers), = sink.on(topics.episodes)
    assert _takeover_header(headers) == str(turns[0].response_length).encode()


def test_the_index_keeps_its_takeover_tokens_through_bytes_and_reads_an_older_index_as_none():
    index = EpisodeIndex(attempt=0, next_turn=1, generator="gen-b", delivery=2, takeover_tokens=12)
    assert index.to_bytes() == b'[0,1,0,1,"gen-b",{"delivery":2,"takeover_tokens":12}]'
    assert EpisodeIndex.from_bytes(index.to_bytes()) == index
    assert EpisodeIndex.from_bytes(b'[0,1,0,1,"gen-b",{"delivery":2}]').takeover_tokens == 0  # written before
    assert EpisodeIndex(0, 1, delivery=2).to_bytes() == b'[0,1,0,1,{"delivery":2}]'  # none: spelled as before
    assert finished_index(index, 0, 9).takeover_tokens == 0
    for bad in (b'[0,1,0,1,{"delivery":2,"takeover_tokens":-1}]', b'[0,1,0,1,{"delivery":2,"takeover_tokens":true}]',
                b'[0,1,0,1,{"delivery":2,"takeover_tokenz":1}]'):
        with pytest.raises(ContractError):
            EpisodeIndex.from_bytes(bad)


def test_decide_carries_the_count_through_later_turns_and_attempts_but_not_into_a_new_episode():
    held = EpisodeIndex(attempt=0, next_turn=1, generator="gen-b", delivery=2, takeover_tokens=7)
    assert decide(held, _h(1, delivery=2, generator="gen-b")).index.takeover_tokens == 7
    retry = decide(held, _h(0, delivery=2, generator="gen-b", attempt=1))
    assert retry.discard_attempt == 0 and not retry.takeover and retry.index.takeover_tokens == 7
    again = decide(held, _h(0, delivery=3, generator="gen-c"))
    assert again.takeover and again.index.takeover_tokens == 7  # the turn merge adds what this one throws away
    assert decide(None, _h(0, delivery=2, generator="gen-b")).index.takeover_tokens == 0
