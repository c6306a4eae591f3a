"""The stream stage's ways out for what cannot become an episode: rollout.dlq, and ``abandoned`` episodes.

Why: every record must end in exactly one counted outcome, and every group the shard writer waits
for must complete from the log alone, even when one of its episodes never will (WIRE.md section 5.2).

* Records deleted before the worker read them go to rollout.dlq as one ``lost`` letter per range
  (``dead_letter.lost_letter``: empty key, no value, the range in ``dlq.source`` and ``dlq.lost``).
* A rejected record goes to rollout.dlq as a ``DeadLetter``, counted ``dlq.<kind>``; one too large to
  copy goes by reference (value null, kind ``too_large``, the original at ``dlq.source``). Never fatal.
* An episode that will never be emitted is said so on rollout.episodes with an ``abandoned`` control
  record (``control_records.Abandoned``, keyed by the rollout key): when its final turn is dead-lettered (what
  is stored of it goes to the DLQ too, kind ``abandoned``), when it cannot be merged (every turn to the
  DLQ, kind ``merge``), and when its episode record is over the size limit (dead-lettered by reference,
  kind ``too_large``, the final turn's source and the offsets of its turns in the reason). The episode
  is then marked finished like an emitted one.
* An episode left without a final turn when the run ends on its partition (``unfinished``): every stored turn to
  the DLQ as ``unfinished``, with rebuilt headers (the episode's ``generator`` included) and a reason naming the key,
  the turns and the generator; one WARNING line; an ``abandoned`` record whose source is the end-of-run marker; and
  nothing of it left in the state (no finished marker: the run is over).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rollout_bus.errors import ContractError, RecordTooLargeError
from rollout_bus.streams.episode_state import EpisodeIndex, index_key, parse_stored_turn, turn_key
from rollout_bus.streams.held_turns import dead_key
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.wire.dead_letter import MAX_REASON_CHARS, DeadLetter, DlqKind, DlqStage, lost_letter
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.wire.control_records import Abandoned
from rollout_bus.wire.rollout_key import parse_rollout_key
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)

STAGE = DlqStage.STREAM
StoredTurn = tuple[int, int, bytes]  # source offset, sent_at_ms, payload (``episode_state.parse_stored_turn``)
Finish = Callable[[EpisodeIndex, bytes, TurnHeaders, TurnRecord], None]


def original_record(final: TurnRecord, headers: TurnHeaders, attempt: int, turn: int,
                    stored: StoredTurn) -> TurnRecord:
    """A stored turn of ``final``'s episode as the record it came from (for the DLQ)."""
    offset, sent_at, payload = stored
    original = TurnHeaders(turn, attempt, False, headers.group_size, sent_at).to_kafka()
    return TurnRecord(final.key, payload, original, final.topic, final.partition, offset, final.timestamp_ms)


class Rejections:
    """Dead letters and abandoned episodes over a processor's table, sender and outcome counts.

    ``finish(index, key, headers, final)`` leaves an episode's finished marker and forgets its stored
    turns; ``forget(key)`` deletes one state entry (both the processor's, which keeps caches of them).
    """

    def __init__(self, table: ChangelogState, send: Any, topics: Topics, outcomes: Counter, *, finish: Finish,
                 forget: Callable[[bytes], None]) -> None:
        self.table, self.send, self.topics, self.outcomes = table, send, topics, outcomes
        self.finish, self.forget = finish, forget

    async def dead_letter(self, record: TurnRecord, kind: str, reason: str, *, by_reference: bool = False) -> None:
        """The record, with why, to the DLQ; one too large to copy goes by reference (value null, kind
        ``too_large``, the original at ``dlq.source``)."""
        value = None if by_reference else record.value
        letter = DeadLetter(record.key, value, list(record.headers), reason, STAGE, kind, record.source)
        try:
            await self.send(self.topics.dlq, record.key, value, letter.record_headers(), wait=True)
        except RecordTooLargeError as exc:
            if by_reference:
                raise
            size = len(record.value or b"")
            await self.dead_letter(record, DlqKind.TOO_LARGE, f"too large to copy ({size} bytes: {exc}); the original "
                                                              f"is at {record.source}; {kind}: {reason}",
                                   by_reference=True)
            return
        self.outcomes[f"dlq.{kind}"] += 1
        logger.warning("dead letter kind=%s source=%s reason=%s", kind, record.source, reason[:300])

    async def lost(self, topic: str, partition: int, first: int, count: int, log_start: int) -> None:
        """Records deleted before the worker read them: one ERROR line and one ``lost`` dead letter naming
        the range (there is no record to copy), counted in ``records_lost``."""
        letter = lost_letter(STAGE, topic, partition, first, count, log_start)
        await self.send(self.topics.dlq, letter.key, None, letter.record_headers(), wait=True)
        self.outcomes[f"dlq.{DlqKind.LOST}"] += 1
        self.outcomes["records_lost"] += count
        logger.error("LOST %s", letter.reason)

    async def abandon(self, record: TurnRecord, headers: TurnHeaders, kind: str, reason: str) -> None:
        """A dead-lettered final turn ends its episode: what is stored of it goes to the DLQ too, and an
        ``abandoned`` record tells the shard writer the episode will never come (its group completes
        without it). Nothing happens for an episode already finished, or a key that names no group."""
        try:
            parse_rollout_key(record.key)
        except ContractError:
            logger.warning("final turn at %s names no rollout group: no abandoned record", record.source)
            return
        raw = self.table.get(index_key(record.key))
        index = EpisodeIndex.from_bytes(raw) if raw is not None else None
        if index is not None and index.finished:
            return
        if index is not None:
            why = f"episode abandoned: its final turn ({record.source}) was dead-lettered ({kind}): {reason}"
            for turn in range(index.next_turn):
                stored = self.table.get(turn_key(record.key, index.attempt, turn))
                if stored is not None:
                    await self.dead_letter(original_record(record, headers, index.attempt, turn,
                                                           parse_stored_turn(stored)), DlqKind.ABANDONED, why)
                    self.forget(turn_key(record.key, index.attempt, turn))
        await self._send_abandoned(record, headers, kind, reason)
        opened = EpisodeIndex(headers.attempt, headers.turn + 1, False, headers.group_size)
        self.finish(opened, record.key, headers, record)

    async def reject_episode(self, index: EpisodeIndex, record: TurnRecord, headers: TurnHeaders,
                             stored: Sequence[StoredTurn], reason: str) -> None:
        """Every turn of an unmergeable episode goes to the DLQ; the episode is abandoned and marked finished."""
        for turn, found in enumerate(stored):
            await self.dead_letter(original_record(record, headers, headers.attempt, turn, found), DlqKind.MERGE,
                                   reason)
        await self.dead_letter(record, DlqKind.MERGE, reason)
        await self._send_abandoned(record, headers, DlqKind.MERGE, reason)
        self.finish(index, record.key, headers, record)

    async def too_large(self, index: EpisodeIndex, record: TurnRecord, headers: TurnHeaders,
                        stored: Sequence[StoredTurn], size: int, exc: BaseException) -> None:
        """An episode record of ``size`` bytes refused for its size: dead-lettered by reference, abandoned."""
        reason = (f"episode record of {size} bytes is over the size limit ({exc}); dead-lettered by "
                  f"reference: its turns are at {record.topic}:{record.partition} offsets "
                  f"{[offset for offset, _, _ in stored] + [record.offset]}")
        await self.dead_letter(record, DlqKind.TOO_LARGE, reason, by_reference=True)
        await self._send_abandoned(record, headers, DlqKind.TOO_LARGE, reason)
        self.finish(index, record.key, headers, record)
        self.outcomes["episodes_too_large"] += 1

    async def unfinished(self, marker: TurnRecord, key: bytes, index: EpisodeIndex) -> None:
        """An open episode when the run ended on ``marker``'s partition: its stored turns go to the DLQ as
        ``unfinished`` (rebuilt headers, its generator's included), one WARNING line, an ``abandoned`` record
        (source: the marker), and its index, stored turns and dead-turn marks leave the state."""
        stored = {turn: parse_stored_turn(raw) for turn in range(index.next_turn)
                  if (raw := self.table.get(turn_key(key, index.attempt, turn))) is not None}
        made_by = (f"generator {index.generator!r}" if index.generator is not None
                   else "a generator that sent no generator header")
        reason = (f"episode {key.decode(errors='replace')} attempt {index.attempt} never got its final turn: the run "
                  f"ended on {marker.topic} partition {marker.partition} (end-of-run at {marker.source}) with turns "
                  f"0..{index.next_turn - 1} of {index.next_turn} stored (offsets "
                  f"{[offset for offset, _, _ in stored.values()]}) and no final turn; made by {made_by}")
        for turn, (offset, sent_at, payload) in stored.items():
            headers = TurnHeaders(turn, index.attempt, False, index.group_size, sent_at, generator=index.generator)
            original = TurnRecord(key, payload, headers.to_kafka(), marker.topic, marker.partition, offset,
                                  marker.timestamp_ms)
            await self.dead_letter(original, DlqKind.UNFINISHED, reason)
        logger.warning("UNFINISHED episode key=%r attempt=%d turns=%d by %s: no final turn when the run ended on "
                       "partition %d; dead-lettered and abandoned", key, index.attempt, index.next_turn, made_by,
                       marker.partition)
        try:
            parse_rollout_key(key)
        except ContractError:
            logger.warning("unfinished episode key=%r names no rollout group: no abandoned record", key)
        else:
            await self._abandoned(key, index.attempt, index.group_size, DlqKind.UNFINISHED, reason, marker.source)
        for turn in range(index.next_turn + 1):
            self.forget(turn_key(key, index.attempt, turn))
            self.forget(dead_key(key, index.attempt, turn))
        self.forget(index_key(key))
        self.outcomes["episodes_unfinished"] += 1

    async def _send_abandoned(self, record: TurnRecord, headers: TurnHeaders, kind: str, reason: str) -> None:
        await self._abandoned(record.key, headers.attempt, headers.group_size, kind, reason, record.source)

    async def _abandoned(self, key: bytes, attempt: int, group_size: int, kind: str, reason: str, source: str) -> None:
        marker = Abandoned(attempt, group_size, kind, reason[:MAX_REASON_CHARS], source)
        await self.send(self.topics.episodes, key, marker.value(), marker.headers(), wait=True)
        self.outcomes["episodes_abandoned"] += 1
