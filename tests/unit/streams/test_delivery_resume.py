"""A delivery that resumes an episode from the log: the stream keeps the turns below its first one, whoever made
them, and the merged episode is the one an undisturbed run merges, byte for byte."""

from __future__ import annotations

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.streams.episode_state import Action, EpisodeIndex, decide
from rollout_bus.wire.codec import encode_samples
from rollout_bus.wire.episode_record import TURN_FIELDS, decode_episode
from rollout_bus.wire.headers import HEADER_TAKEOVER_TOKENS, TurnHeaders
from tests.unit.streams.test_delivery_takeover import _with_delivery
from tests.wire_schemas import header_object, problems, validate


def _h(turn: int, *, delivery: int, generator: str, attempt: int = 0, resumed: bool = False) -> TurnHeaders:
    return TurnHeaders(turn=turn, attempt=attempt, final=False, group_size=4, sent_at_ms=5, generator=generator,
                       delivery=delivery, resumed=resumed)


OPEN_1 = EpisodeIndex(attempt=0, next_turn=3, generator="gen-a", delivery=1)


@pytest.mark.parametrize("turn", [1, 2, 3])
def test_a_resumed_turn_keeps_the_stored_turns_below_it_and_discards_the_rest(turn):
    decision = decide(OPEN_1, _h(turn, delivery=2, generator="gen-b", resumed=True))
    assert decision.action is Action.STORE and decision.takeover
    assert (decision.discard_attempt, decision.discard_turns, decision.keep_turns) == (0, 3, turn)
    assert (decision.index.generator, decision.index.delivery, decision.index.next_turn) == ("gen-b", 2, turn + 1)


@pytest.mark.parametrize("headers", [
    _h(4, delivery=2, generator="gen-b", resumed=True),  # turn 3 is not stored: it must come first
    _h(2, delivery=2, generator="gen-b", attempt=1, resumed=True),  # another attempt's turns are not these
    _h(2, delivery=2, generator="gen-b"),  # no resumed header: a new delivery starts at turn 0
], ids=["ahead", "other-attempt", "not-resumed"])
def test_a_resumed_turn_that_does_not_continue_the_stored_ones_is_held(headers):
    assert decide(OPEN_1, headers).action is Action.HOLD


def test_the_resumed_header_round_trips_and_is_refused_without_a_delivery_or_at_turn_0():
    headers = _h(2, delivery=2, generator="gen-b", resumed=True)
    assert headers.to_kafka()[-1] == ("resumed", b"1")
    assert TurnHeaders.from_kafka(headers.to_kafka()) == headers
    validate("turn_headers", header_object(headers.to_kafka()))
    assert "resumed" not in dict(_h(2, delivery=2, generator="gen-b").to_kafka())
    for bad, says in [(_h(2, delivery=2, generator="g").to_kafka() + [("resumed", b"yes")], "must be 1"),
                      (_h(0, delivery=2, generator="g").to_kafka() + [("resumed", b"1")], "turn above 0"),
                      (TurnHeaders(2, 0, False, 4, 5).to_kafka() + [("resumed", b"1")], "needs a 'delivery'")]:
        with pytest.raises(ContractError, match=says):
            TurnHeaders.from_kafka(bad)
    assert problems("turn_headers", header_object(TurnHeaders(2, 0, False, 4, 5).to_kafka() + [("resumed", b"1")]))


def _taker(samples, first_turn: int, *, delivery: int = 2, generator: str = "gen-b", offset: int = 10):
    """A resuming delivery's records: turns ``first_turn``.. of the episode, the first with the resumed header."""
    from rollout_bus.streams.turn_record import TurnRecord
    from tests.unit.streams.test_episode_state import _records

    out = []
    for i, r in enumerate(_records(samples, start_offset=offset)):
        h = TurnHeaders.from_kafka(r.headers)
        headers = TurnHeaders(first_turn + i, h.attempt, h.final, h.group_size, h.sent_at_ms, generator=generator,
                              delivery=delivery, resumed=i == 0).to_kafka()
        out.append(TurnRecord(r.key, r.value, headers, r.topic, r.partition, r.offset, r.timestamp_ms))
    return out


def _in_order(records):
    """The records as one partition holds them: offsets 0, 1, ... in this order."""
    from dataclasses import replace

    return [replace(r, offset=i) for i, r in enumerate(records)]


def _segments(value: bytes) -> bytes:
    """An episode record's segments, as bytes (its metadata says when the final turn was sent: not compared)."""
    segments, _ = decode_episode(value)
    return encode_samples(segments, TURN_FIELDS)


def _episode_value(records) -> bytes:
    from tests.unit.streams.test_episode_state import _processor, _run

    processor, sink, topics = _processor()
    _run(processor, records)
    (_, _, value, _), = sink.on(topics.episodes)
    return _segments(value)


def test_a_resumed_episode_merges_to_the_undisturbed_bytes_and_the_zombie_is_fenced():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    turns = _episode(11, 5)
    undisturbed = _episode_value(_with_delivery(_records(turns), 1, "gen-a"))
    processor, sink, topics = _processor()
    records = _records(turns)
    dead = _with_delivery(records, 1, "gen-a")[:3]  # turns 0-2 published, the generator died in turn 3
    zombie_early = _with_delivery(records, 1, "gen-a")[3:4]  # its turn 3 lands before the taker's
    taker = _taker(turns[2:], 2)  # the log held turns 0-1 when it took over
    zombie_late = _with_delivery(records, 1, "gen-a")[4:]  # its late final turn
    _run(processor, _in_order(dead + zombie_early + taker + zombie_late))
    (_, _, value, headers), = sink.on(topics.episodes)
    assert _segments(value) == undisturbed and not sink.on(topics.dlq)
    counts = processor.outcomes
    assert (counts["resumed_episodes"], counts["resumed_turns_kept"], counts["taken_over_episodes"]) == (1, 2, 0)
    assert counts["takeover_turns_discarded"] == 2 and counts["fenced_turns"] == 1  # stored 2 and 3; the final
    thrown_away = turns[2].response_length + turns[3].response_length
    assert counts["takeover_tokens_discarded"] == thrown_away
    assert dict(headers)[HEADER_TAKEOVER_TOKENS] == str(thrown_away).encode()


def test_an_episode_resumed_with_nothing_thrown_away_has_no_takeover_header():
    from tests.unit.streams.test_episode_state import _episode, _processor, _records, _run

    turns = _episode(12, 4)
    processor, sink, topics = _processor()
    records = _records(turns)
    taker = _taker(turns[2:], 2)
    _run(processor, _in_order(_with_delivery(records, 1, "gen-a")[:2] + taker))
    (_, _, value, headers), = sink.on(topics.episodes)
    assert _segments(value) == _episode_value(_with_delivery(records, 1, "gen-a"))
    assert HEADER_TAKEOVER_TOKENS not in dict(headers)
    assert processor.outcomes["resumed_turns_kept"] == 2 and processor.outcomes["takeover_turns_discarded"] == 0
