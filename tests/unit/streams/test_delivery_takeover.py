"""Deliveries of a prompt group in the stream's state machine: a takeover is not a collision, a zombie is fenced."""

from __future__ import annotations

import pytest

from rollout_bus.streams.episode_state import Action, EpisodeIndex, decide, finished_index
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.headers import TurnHeaders


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
