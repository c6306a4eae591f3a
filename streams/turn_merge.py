"""One turn record to its outcome: ignored, dead-lettered, held, stored, or merged into its episode.

Why apart from ``rollout_bus.streams.processor``: the processor says which records are processed and when
their effects are written (positions, batches, drains, rebalances); this module says what one turn does to
its episode's state, and nothing here reads a position or awaits an acknowledgement.

Contract (state keys in ``episode_state`` and ``held_turns``):

* ``turn(record)`` decides the turn against its episode index (``episode_state.decide``): a duplicate or a
  superseded turn is counted and ignored, and so are a zombie generator's ``fenced`` turn (a lower delivery)
  and a finished episode ``redone`` by a higher delivery; a turn that starts a new attempt discards the stored
  turns of the old one (a new delivery's: counted as taken over, not superseded, with the response tokens it
  throws away: ``takeover_tokens_discarded``, and added to the episode's index, so its episode record's
  ``takeover_tokens`` header carries them to the shard writer's flow, across a restart too); a turn ahead of
  its predecessor is held and taken up again once the predecessor is stored; a stored turn is kept as parsed on
  arrival while the worker lives, so merging decodes nothing twice (``decode_turn`` reads one back from the state
  after a recovery).
* A rejected turn goes to rollout.dlq (``rejections``); a rejected final turn abandons its episode, and any
  other turn dead-lettered for itself leaves a ``dead_key`` marker, so its successor is a ``gap`` at once.
* A final turn merges the stored turns with it (one reward: ``share_final_reward``) and sends the episode
  record without waiting: the send joins the in-flight finals (``in_flight``) with its deferred effects,
  ``count`` (into its window entry) and then ``finish`` (the finished marker, the stored turns deleted).
* ``expire_held(partition)``: at the run's end on ``partition`` a held turn still ahead of its predecessor
  is a ``gap`` dead letter (a final one abandons its episode).
* ``settle_unfinished(marker, settles_on)``: then an open episode of that partition (stored turns, no final
  turn) is dead-lettered ``unfinished`` and abandoned, and nothing of it stays in the state. An open episode's
  index records the partition its last turn was stored from.
* ``prune_finished(partition, position)`` deletes the finished markers ``finished_markers`` says are due.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from rollout_bus.errors import ContractError, RecordTooLargeError
from rollout_bus.model.sample import Sample
from rollout_bus.model.turns import merge_samples
from rollout_bus.streams.episode_state import (Action, Decision, EpisodeIndex, decide, finished_index, index_key,
                                              parse_stored_turn, share_final_reward, stored_turn, turn_key)
from rollout_bus.streams.finished_markers import FinishedMarkers
from rollout_bus.streams.held_turns import dead_key, held_key, held_record, hold_value, is_held_key
from rollout_bus.streams.in_flight import Final, InFlight
from rollout_bus.streams.rejections import Rejections, StoredTurn
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.turn_record import Rejected, TurnRecord, parse_headers, parse_sample
from rollout_bus.streams.window_metrics import WindowMetrics
from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.episode_record import TURN_FIELDS, EpisodeInfo, encode_episode
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)


# What an ignored turn is counted as (the stream's outcome counts).
_IGNORED = {Action.DUPLICATE: "duplicates_ignored", Action.SUPERSEDED: "superseded_turns",
            Action.FENCED: "fenced_turns", Action.REDONE: "redone_turns"}


def decode_turn(payload: bytes) -> Sample:
    """A stored turn's payload as its sample again (after a recovery nothing parsed on arrival is cached)."""
    return decode_samples(payload, TURN_FIELDS)[0][0]


class TurnMerge:
    """Turns into stored state and episode records, over a processor's table, sender, outcome counts,
    window metrics, in-flight finals and finished markers; ``rejects`` its ways out (``rejections``)."""

    def __init__(self, table: ChangelogState, send: Any, topics: Topics, outcomes: Counter, *,
                 windows: WindowMetrics, in_flight: InFlight, markers: FinishedMarkers) -> None:
        self.table, self.send, self.topics, self.outcomes = table, send, topics, outcomes
        self.windows, self.in_flight, self.markers = windows, in_flight, markers
        self.rejects = Rejections(table, send, topics, outcomes, finish=self.finish, forget=self.forget)
        self._decoded: dict[bytes, Sample] = {}  # stored turns as parsed on arrival: no second decode to merge

    def forget_decoded(self) -> None:
        """Drop the stored turns parsed on arrival (after a rebalance they are decoded from the table)."""
        self._decoded.clear()

    async def turn(self, record: TurnRecord, *, released: bool = False) -> None:
        """One turn record to its outcome; a dead-lettered final turn abandons its episode. ``released``: a
        held turn taken up again once its predecessor is stored (counted once, when it arrived)."""
        if not released:
            self.outcomes["turns_received"] += 1
        headers = None
        try:
            headers = parse_headers(record)
            sample = parse_sample(record)
            raw_index = self.table.get(index_key(record.key))
            index = EpisodeIndex.from_bytes(raw_index) if raw_index is not None else None
            decision = decide(index, headers)
            if (index is not None and index.finished and headers.final and headers.attempt == index.attempt
                    and headers.delivery == index.delivery):
                for turn in range(headers.turn):  # a replayed final: stored turns a crash left behind the marker
                    self.forget(turn_key(record.key, headers.attempt, turn))
            await self._apply(decision, record, headers, sample)
        except Rejected as rejected:
            await self.rejects.dead_letter(record, rejected.kind, rejected.reason)
            if headers is None or rejected.kind in (DlqKind.COLLISION, DlqKind.FINISHED):
                return  # another generator's turn, or one after the end: the episode held is not touched
            if headers.final:
                await self.rejects.abandon(record, headers, rejected.kind, rejected.reason)
            else:
                await self._never_merged(record, headers, rejected.kind)

    async def _never_merged(self, record: TurnRecord, headers: TurnHeaders, kind: str) -> None:
        """A turn dead-lettered for itself: its successor (held now, or arriving later) can never merge, so it is
        a ``gap`` at once rather than at the run's end."""
        self.table[dead_key(record.key, headers.attempt, headers.turn)] = b"%d" % record.partition
        raw = self.table.get(held_key(record.key, headers.attempt, headers.turn + 1))
        if raw is not None:
            self.forget(held_key(record.key, headers.attempt, headers.turn + 1))
            await self.turn(held_record(held_key(record.key, headers.attempt, headers.turn + 1), raw), released=True)

    async def _apply(self, decision: Decision, record: TurnRecord, headers: TurnHeaders, sample: Sample) -> None:
        if decision.action in _IGNORED:
            self.outcomes[_IGNORED[decision.action]] += 1
            log = logger.info if decision.action is Action.FENCED else logger.debug
            log("ignored %s key=%r offset=%d: %s", decision.action.value, record.key, record.offset, decision.reason)
            return
        if decision.action is Action.DLQ:
            raise Rejected(decision.kind, decision.reason)
        if decision.action is Action.HOLD:
            self._hold(decision, record, headers)
            return
        if decision.discard_attempt is not None:
            kept = decision.keep_turns  # a resumed episode keeps the turns below the resumed one
            if decision.takeover:  # another delivery's attempt: its generator died or was fenced
                tokens = self._response_tokens(record.key, decision.discard_attempt, decision.discard_turns, kept)
                self.outcomes["resumed_episodes" if kept else "taken_over_episodes"] += 1
                self.outcomes["resumed_turns_kept"] += kept
                self.outcomes["takeover_turns_discarded"] += decision.discard_turns - kept
                self.outcomes["takeover_tokens_discarded"] += tokens
                taken = replace(decision.index, takeover_tokens=decision.index.takeover_tokens + tokens)
                decision = replace(decision, index=taken)  # the episode record will say what was thrown away
            for turn in range(kept, decision.discard_turns):
                self.forget(turn_key(record.key, decision.discard_attempt, turn))
            if not decision.takeover:
                self.outcomes["superseded_attempts"] += 1
                self.outcomes["superseded_turns_discarded"] += decision.discard_turns
        if decision.action is Action.STORE:
            key = turn_key(record.key, headers.attempt, headers.turn)
            self.table[key] = stored_turn(record.offset, headers.sent_at_ms, record.value or b"")
            self._decoded[key] = sample
            self.table[index_key(record.key)] = replace(decision.index, partition=record.partition).to_bytes()
            self.outcomes["turns_stored"] += 1
            await self._release_next(record.key, headers.attempt, headers.turn + 1)
            return
        await self._emit(decision.index, record, headers, sample)

    def _hold(self, decision: Decision, record: TurnRecord, headers: TurnHeaders) -> None:
        """Keep a turn ahead of its predecessor in the state, unless that predecessor was dead-lettered."""
        if dead_key(record.key, headers.attempt, headers.turn - 1) in self.table:
            raise Rejected(DlqKind.GAP, f"{decision.reason}; turn {headers.turn - 1} was dead-lettered")
        self.table[held_key(record.key, headers.attempt, headers.turn)] = hold_value(record)
        self.outcomes["turns_held"] += 1
        logger.info("holding key=%r turn=%d attempt=%d offset=%d until its predecessor arrives: %s", record.key,
                    headers.turn, headers.attempt, record.offset, decision.reason)

    async def _release_next(self, key: bytes, attempt: int, turn: int) -> None:
        """The turn held for ``(attempt, turn)`` of ``key``, if any, is processed now that its predecessor is stored."""
        raw = self.table.get(held_key(key, attempt, turn))
        if raw is None:
            return
        self.forget(held_key(key, attempt, turn))
        self.outcomes["turns_released"] += 1
        await self.turn(held_record(held_key(key, attempt, turn), raw), released=True)

    async def expire_held(self, partition: int) -> None:
        """At the run's end on ``partition`` no predecessor can come: every turn still held there is decided
        once more, and one still ahead of its predecessor is a ``gap`` dead letter (a final one abandons)."""
        for key in sorted(k for k in list(self.table.keys()) if is_held_key(k)):
            raw = self.table.get(key)
            if raw is None:  # released meanwhile by an earlier one
                continue
            record = held_record(key, raw)
            if record.partition != partition:
                continue
            self.forget(key)
            headers = parse_headers(record)
            index_raw = self.table.get(index_key(record.key))
            decision = decide(EpisodeIndex.from_bytes(index_raw) if index_raw is not None else None, headers)
            if decision.action is Action.HOLD:
                reason = f"{decision.reason}; the run ended on this partition before it came"
                await self.rejects.dead_letter(record, DlqKind.GAP, reason)
                if headers.final:
                    await self.rejects.abandon(record, headers, DlqKind.GAP, reason)
            else:
                await self.turn(record, released=True)

    async def settle_unfinished(self, marker: TurnRecord, settles_on: Callable[[bytes, EpisodeIndex], int]) -> None:
        """At the run's end on ``marker``'s partition, an open episode whose turns that partition takes
        (``settles_on(key, index)``) will never get its final turn: dead-lettered ``unfinished``, abandoned, its
        state removed (``Rejections.unfinished``). Called once held turns are decided and finals drained."""
        for key in sorted(k for k in list(self.table.keys()) if k.startswith(b"e|")):
            raw = self.table.get(key)
            index = EpisodeIndex.from_bytes(raw) if raw is not None else None
            if index is None or index.finished or settles_on(key[2:], index) != marker.partition:
                continue
            await self.rejects.unfinished(marker, key[2:], index)

    def _response_tokens(self, key: bytes, attempt: int, count: int, first: int = 0) -> int:
        """The response tokens of an attempt's stored turns first..count-1 (what a takeover throws away)."""
        total = 0
        for turn in range(first, count):
            raw = self.table.get(turn_key(key, attempt, turn))
            if raw is not None:
                total += self._stored_sample(key, attempt, turn, parse_stored_turn(raw)[2]).response_length
        return total

    def forget(self, key: bytes) -> None:
        """Delete through ``__delitem__``, the path that writes the changelog tombstone."""
        self._decoded.pop(key, None)
        if key in self.table:
            del self.table[key]

    def _stored_turns(self, key: bytes, attempt: int, count: int) -> list[StoredTurn]:
        """(offset, sent_at_ms, payload) of the stored turns 0..count-1 of an attempt."""
        found = []
        for turn in range(count):
            raw = self.table.get(turn_key(key, attempt, turn))
            if raw is None:
                raise ContractError(f"stored turn {turn} of attempt {attempt} is missing from the state table")
            found.append(parse_stored_turn(raw))
        return found

    def _stored_sample(self, key: bytes, attempt: int, turn: int, payload: bytes) -> Sample:
        """A stored turn's sample: as parsed on arrival, or decoded from the state (after a recovery)."""
        cached = self._decoded.get(turn_key(key, attempt, turn))
        return cached if cached is not None else decode_turn(payload)

    async def _emit(self, index: EpisodeIndex, record: TurnRecord, headers: TurnHeaders, final: Sample) -> None:
        """Merge, publish, count in its window, then forget the turns (in that order)."""
        try:
            stored = self._stored_turns(record.key, headers.attempt, headers.turn)
        except ContractError as exc:
            raise Rejected(DlqKind.STATE, str(exc)) from exc
        try:
            turns = [self._stored_sample(record.key, headers.attempt, turn, payload)
                     for turn, (_, _, payload) in enumerate(stored)] + [final]
            segments = share_final_reward(merge_samples(turns), final)
        except ValueError as exc:
            await self.rejects.reject_episode(index, record, headers, stored, f"episode cannot be merged: {exc}")
            return
        info = EpisodeInfo(attempt=headers.attempt, turns=headers.turn + 1, group_size=headers.group_size,
                           final_sent_at_ms=headers.sent_at_ms, event_time_ms=record.timestamp_ms)
        value = encode_episode(segments, info)
        too_large = partial(self.rejects.too_large, index, record, headers, stored, len(value))
        try:
            delivery = await self.send(self.topics.episodes, record.key, value,
                                       info.headers(takeover_tokens=index.takeover_tokens), wait=False)
        except RecordTooLargeError as exc:
            await too_large(exc)
            return

        def count() -> None:
            self.outcomes["episodes_emitted"] += 1
            self.outcomes["turns_merged"] += len(turns)
            if len(segments) > 1:
                self.outcomes["episodes_with_siblings"] += 1
            self.windows.count(record, segments)

        def finish() -> None:
            self.finish(index, record.key, headers, record)

        self.in_flight.add(Final(record.partition, record.key, delivery, count, finish, too_large))

    def finish(self, index: EpisodeIndex, key: bytes, headers: TurnHeaders, final: TurnRecord) -> None:
        """Leave the finished marker (where the final turn was, for pruning); forget the stored turns."""
        self.table[index_key(key)] = finished_index(index, final.partition, final.offset).to_bytes()
        self.markers.add(final.partition, final.offset, key)
        for turn in range(headers.turn):
            self.forget(turn_key(key, headers.attempt, turn))
            self.forget(dead_key(key, headers.attempt, turn))

    def prune_finished(self, partition: int, position: int) -> None:
        """Delete finished markers far behind the partition's recorded position (``finished_markers``)."""
        if not self.markers.loaded(partition):
            found = []
            for key in [k for k in self.table.keys() if k.startswith(b"e|")]:
                index = EpisodeIndex.from_bytes(self.table[key])
                if index.finished and index.partition == partition and index.final_offset >= 0:
                    found.append((index.final_offset, key[2:]))
            self.markers.load(partition, found)
        for final_offset, key in self.markers.due(partition, position):
            raw = self.table.get(index_key(key))
            if raw is not None and EpisodeIndex.from_bytes(raw).final_offset == final_offset:
                self.forget(index_key(key))
                self.outcomes["finished_markers_pruned"] += 1
