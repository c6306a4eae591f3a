"""The per-episode state machine of the stream stage: pure, no Kafka, no Faust.

Contract:

* An episode (one rollout key) has at most one small ``EpisodeIndex``: the attempt being
  collected, the next turn expected, and whether the episode is finished. Turn payloads are not
  in the index: each is stored once under ``turn_key(key, attempt, turn)`` (``stored_turn``: its
  source offset and sent_at, then the payload) and read back only when the final turn arrives, so
  the state written per turn is constant-size.
* ``decide(index, headers)`` says what to do with one turn record:

  - ``STORE`` the turn (or ``EMIT`` the episode when the turn is final), with the index to write;
  - ``DUPLICATE``: a redelivery of a turn already taken (same attempt, turn below the next
    expected one, or at or below the last turn of a finished episode): ignore it;
  - ``SUPERSEDED``: a turn of an attempt older than the one held: a retry replaced it (Kafka
    keeps one key's records in order, so this is only ever a redelivery): ignore it;
  - ``HOLD`` (kind ``gap`` and why, for when it never resolves): the turn is ahead of its predecessor (it
    skips one, a first turn that is not 0, a new attempt not at turn 0): keep it until the predecessor
    comes; only the run's end makes it a ``gap`` dead letter (``rollout_bus.streams.held_turns``);
  - ``DLQ`` with a ``kind``: ``finished`` (a new turn or a new attempt for a finished episode),
    ``collision`` (another generator's episode holds the key).

  A higher attempt starting at turn 0 discards the older attempt: ``Decision.discard`` lists the
  turn keys to delete.
* Deliveries (the ``delivery`` header of a turn made for a prompt group from rollout.prompts) come before
  attempts: a turn of a higher delivery than the episode's takes it over (the generator of the lower one died
  or was fenced): at turn 0 it discards the open attempt (``Decision.takeover``), whichever generator made it,
  and is never a ``collision``; for an episode already finished it is ``REDONE`` (the same episode by identity,
  made again: ignored and counted). A turn of a lower delivery is ``FENCED``: a zombie's late turn, ignored and
  counted, never merged. The open index sums the response tokens its takeovers threw away
  (``EpisodeIndex.takeover_tokens``, kept through later turns and attempts: ``decide`` carries it on, the turn
  merge, which reads the discarded turns, adds to it) for the episode record's ``takeover_tokens`` header.
  A higher delivery's turn past 0 with the ``resumed`` header *resumes* the open episode instead: the stored
  turns below it (same attempt) are the ones its generator found on the log and kept (``Decision.keep_turns``);
  those at or above it (a zombie's, or one whose progress the dead generator never noted) are discarded as a
  takeover's. Without all the turns below it stored, or of another attempt, it is held (a ``gap`` if never
  resolved), as any turn ahead of its predecessor.
* ``finished_index(index, partition, final_offset)`` is the marker kept after emission (or
  abandonment), so late turns are told apart from redeliveries; it is pruned once the partition
  has moved far past it (``rollout_bus.streams.finished_markers``). ``share_final_reward(segments, final)`` gives every sibling segment the
  final turn's reward, which the trainer requires of one rollout.

Decision where the contract is silent: turns of an older attempt are ignored and counted, for
open and finished episodes alike, because they can only be redeliveries.
"""

from __future__ import annotations

import copy
import json
import struct
from dataclasses import dataclass, replace
from enum import Enum

from rollout_bus.wire.compact_json import compact_json
from rollout_bus.errors import ContractError, must_be
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.model.sample import Sample


class Action(str, Enum):
    STORE = "store"
    EMIT = "emit"
    DUPLICATE = "duplicate"
    SUPERSEDED = "superseded"
    DLQ = "dlq"
    FENCED = "fenced"  # a lower delivery than the episode's: a zombie generator's late turn
    REDONE = "redone"  # a higher delivery for a finished episode: made again after a takeover, already emitted
    HOLD = "hold"  # ahead of its predecessor: kept until it arrives (``held_turns``), a gap only at the run's end


@dataclass(frozen=True)
class EpisodeIndex:
    """What the stage remembers of an episode between turns (a few dozen bytes).

    A finished marker also holds the source ``partition`` and ``final_offset`` of the final turn,
    so it can be pruned once the partition's position is far enough past it
    (``rollout_bus.streams.finished_markers``); -1 where unknown (an older marker). An open episode holds
    the ``partition`` its last turn was stored from (final_offset -1; -1 both in an older index), so the run's
    end on that partition can settle it where one table holds every partition (an offline replay).
    """

    attempt: int
    next_turn: int
    finished: bool = False
    group_size: int = 1
    partition: int = -1
    final_offset: int = -1
    generator: str | None = None  # the ``generator`` header of its turn 0 (None: not said)
    delivery: int = 0  # the prompt group's delivery its turns carry (0: a generator that plans its own groups)
    # Response tokens of lower deliveries' stored turns that takeovers of this open episode discarded (0 in an index
    # written before it was kept, and in a finished marker: the episode record has carried it by then).
    takeover_tokens: int = 0

    def to_bytes(self) -> bytes:
        values: list = [self.attempt, self.next_turn, int(self.finished), self.group_size]
        if self.final_offset >= 0 or self.partition >= 0:
            values += [self.partition, self.final_offset]
        if self.generator is not None:
            values.append(self.generator)
        tail = {"delivery": self.delivery} if self.delivery else {}
        if self.takeover_tokens:
            tail["takeover_tokens"] = self.takeover_tokens
        if tail:
            values.append(tail)
        return compact_json(values)  # a list: key order does not arise

    @classmethod
    def from_bytes(cls, raw: bytes) -> "EpisodeIndex":
        """Strict inverse of ``to_bytes``; ContractError on anything else."""
        shape = ("[attempt, next_turn, finished, group_size] or [..., partition, final_offset], then the generator, "
             "then {\"delivery\": d, \"takeover_tokens\": n}")
        try:
            values = json.loads(raw)
        except (ValueError, TypeError) as exc:
            raise ContractError(must_be("episode index", shape, raw)) from exc
        tail = values.pop() if isinstance(values, list) and values and isinstance(values[-1], dict) else {}
        counts = (tail.get("delivery", 0), tail.get("takeover_tokens", 0))
        if set(tail) - {"delivery", "takeover_tokens"} or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            raise ContractError(must_be("episode index", shape, raw))
        delivery, takeover_tokens = counts
        generator = values.pop() if isinstance(values, list) and values and isinstance(values[-1], str) else None
        if not isinstance(values, list) or len(values) not in (4, 6):
            raise ContractError(must_be("episode index", shape, raw))
        open_at = len(values) == 6 and values[2] == 0 and values[5] == -1  # an open episode's partition
        if (not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values[:5 if open_at else 6])
                or values[2] > 1):
            raise ContractError(must_be("episode index", "non-negative integers", raw))
        attempt, next_turn, finished, group_size, *where = values
        partition, final_offset = where or (-1, -1)
        return cls(attempt, next_turn, bool(finished), group_size, partition, final_offset, generator, delivery,
                   takeover_tokens)


@dataclass(frozen=True)
class Decision:
    """What to do with one turn record."""

    action: Action
    index: EpisodeIndex | None = None  # the index to write (STORE / EMIT)
    discard_attempt: int | None = None  # an older attempt whose stored turns must be deleted
    discard_turns: int = 0  # how many turns that attempt had stored
    kind: DlqKind | str = ""
    reason: str = ""  # human-readable, for the DLQ and the log
    takeover: bool = False  # the discarded attempt was another delivery's (a generator that died or was fenced)
    keep_turns: int = 0  # a resumed episode: the discarded attempt's turns below this are kept, not discarded


def index_key(rollout_key: bytes) -> bytes:
    """State-table key of an episode's index entry."""
    return b"e|" + rollout_key


def turn_key(rollout_key: bytes, attempt: int, turn: int) -> bytes:
    """State-table key of one stored turn payload."""
    return b"t|%d|%d|" % (attempt, turn) + rollout_key


_STORED = struct.Struct(">qq")  # source offset, sent_at_ms of a stored turn


def stored_turn(offset: int, sent_at_ms: int, payload: bytes) -> bytes:
    """State-table value of one stored turn: a 16-byte prefix (its source offset and sent_at), then
    the raw payload, stored once."""
    return _STORED.pack(offset, sent_at_ms) + payload


def parse_stored_turn(raw: bytes) -> tuple[int, int, bytes]:
    """(source offset, sent_at_ms, payload) of a ``stored_turn`` value."""
    offset, sent_at = _STORED.unpack_from(raw)
    return offset, sent_at, raw[_STORED.size:]


def _accept(headers: TurnHeaders, held: EpisodeIndex | None = None, *, discard: bool = False,
            generator: str | None = None) -> Decision:
    """Store or emit the turn; ``held`` (the episode's open index) hands on its ``takeover_tokens``, and with
    ``discard`` its attempt's stored turns are thrown away."""
    index = EpisodeIndex(headers.attempt, headers.turn + 1, False, headers.group_size,
                         generator=generator if generator is not None else headers.generator,
                         delivery=headers.delivery, takeover_tokens=held.takeover_tokens if held else 0)
    action = Action.EMIT if headers.final else Action.STORE
    if held is None or not discard:
        return Decision(action, index)
    return Decision(action, index, discard_attempt=held.attempt, discard_turns=held.next_turn,
                    takeover=held.delivery != headers.delivery)


def _decide_delivery(index: EpisodeIndex, headers: TurnHeaders) -> Decision:
    """A turn of another delivery of the prompt group than the one the episode holds (see the module docstring)."""
    said = f"turn {headers.turn} of delivery {headers.delivery} from generator {headers.generator!r}"
    if headers.delivery < index.delivery:
        return Decision(Action.FENCED, reason=f"{said}: delivery {index.delivery} took the episode over "
                                              f"(from generator {index.generator!r})")
    if index.finished:
        return Decision(Action.REDONE, reason=f"{said}: the episode was finished by delivery {index.delivery}")
    if headers.turn == 0:
        return _accept(headers, index, discard=True)
    if headers.resumed and headers.attempt == index.attempt and headers.turn <= index.next_turn:
        resumed = _accept(headers, index, discard=True)
        return replace(resumed, keep_turns=headers.turn)
    return Decision(Action.HOLD, kind=DlqKind.GAP, reason=f"{said} arrived before its turn 0 (delivery "
                                                     f"{index.delivery} was open)")


def _decide_finished(index: EpisodeIndex, headers: TurnHeaders) -> Decision:
    last_turn = index.next_turn - 1
    if headers.attempt < index.attempt:
        return Decision(Action.SUPERSEDED, reason=f"attempt {headers.attempt} < finished attempt {index.attempt}")
    if headers.attempt == index.attempt and headers.turn <= last_turn:
        return Decision(Action.DUPLICATE, reason=f"turn {headers.turn} of a finished episode, already emitted")
    return Decision(Action.DLQ, kind=DlqKind.FINISHED,
                    reason=f"turn {headers.turn} of attempt {headers.attempt} arrived for an episode already "
                           f"finished at attempt {index.attempt}, turn {last_turn}")


def decide(index: EpisodeIndex | None, headers: TurnHeaders) -> Decision:
    """The fate of one turn, given the episode's index (None: nothing seen yet)."""
    if index is None:
        if headers.turn == 0:
            return _accept(headers)
        return Decision(Action.HOLD, kind=DlqKind.GAP, reason=f"turn {headers.turn} of attempt {headers.attempt} "
                                                         f"arrived but turn 0 was never seen")
    if headers.delivery != index.delivery:
        return _decide_delivery(index, headers)
    if index.generator is not None and headers.generator is not None and index.generator != headers.generator:
        return Decision(Action.DLQ, kind=DlqKind.COLLISION,
                        reason=f"turn {headers.turn} of attempt {headers.attempt} is from generator "
                               f"{headers.generator!r}, but generator {index.generator!r} already made this episode "
                               f"(the same rollout key): give each generator of a run its own group indices "
                               f"(--generators N --generator-index I) or its own adapter")
    if index.finished:
        return _decide_finished(index, headers)
    if headers.attempt < index.attempt:
        return Decision(Action.SUPERSEDED, reason=f"attempt {headers.attempt} < current attempt {index.attempt}")
    if headers.attempt > index.attempt:
        if headers.turn == 0:
            return _accept(headers, index, discard=True, generator=index.generator)
        return Decision(Action.HOLD, kind=DlqKind.GAP, reason=f"attempt {headers.attempt} starts at turn "
                                                         f"{headers.turn}, not 0 (attempt {index.attempt} was open)")
    if headers.turn < index.next_turn:
        return Decision(Action.DUPLICATE, reason=f"turn {headers.turn} already stored")
    if headers.turn > index.next_turn:
        return Decision(Action.HOLD, kind=DlqKind.GAP, reason=f"turn {headers.turn} of attempt {headers.attempt} "
                                                         f"skips turn {index.next_turn}")
    return _accept(headers, index, generator=index.generator)


def finished_index(index: EpisodeIndex, partition: int = -1, final_offset: int = -1) -> EpisodeIndex:
    """The marker left once the episode is emitted: same attempt and last turn, finished, and
    where its final turn was (for pruning)."""
    return EpisodeIndex(index.attempt, index.next_turn, True, index.group_size, partition, final_offset,
                        index.generator, index.delivery)


def share_final_reward(segments: list[Sample], final: Sample) -> list[Sample]:
    """Every sibling segment gets the final turn's reward; ``metadata["raw_reward"]``, where the
    final turn or a segment has one, becomes the final turn's raw reward (else its reward).

    The trainer normalises rewards per rollout and refuses siblings that disagree.
    """
    final_has_raw = isinstance(final.metadata, dict) and "raw_reward" in final.metadata
    raw = final.metadata["raw_reward"] if final_has_raw else final.reward
    for segment in segments:
        segment.reward = copy.deepcopy(final.reward)
        if final_has_raw or (isinstance(segment.metadata, dict) and "raw_reward" in segment.metadata):
            segment.metadata = {**segment.metadata, "raw_reward": copy.deepcopy(raw)}
    return segments
