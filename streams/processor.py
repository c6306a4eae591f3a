"""The stream stage's work: batches of rollout.turns records in, their effects out.

This module reads the records exactly once (batches, positions, catch-up, drains, rebalances); what a
turn does to its episode is ``rollout_bus.streams.turn_merge``'s, what a control record does
``rollout_bus.streams.end_of_run``'s.

Contract:

* All state lives in one table (a ``ChangelogState``: bytes keys, bytes values), so its changelog
  partition is one ordered log of every state change of the matching source partition; after a
  crash the recovered state is a prefix of the writes. The writes of a batch are handed to the
  producer before its records are acknowledged, so the offset commit flushes them. Keys
  (``episode_state`` / ``windows``): ``e|key`` episode index, ``t|attempt|turn|key`` one turn
  (``episode_state.stored_turn``: source offset and sent_at, then the raw payload, stored once),
  ``w|partition|start|adapter`` a window entry,
  ``c|partition`` the partition's closed-until time, ``o|partition`` the next source offset to
  process (written last for every batch, so the recovered state says which records it holds:
  replays below it are skipped, and records Faust acknowledged without delivering them to the
  agent, as it does around rebalances and restarts, are read again through ``fetch``).
* ``handle_batch`` processes its records in order, then drains their finals: the changelog is
  flushed, the window entries written and the positions recorded once per batch rather than
  per record (``tests/unit/streams/test_processor_batches.py`` cuts the changelog at every
  write and replays: no episode is lost and none is counted twice). Stored turns are kept as
  parsed on arrival while the worker lives, so merging an episode decodes nothing twice.
* A final turn's effects run in this order: send the episode; once the broker has acknowledged
  it, count it in its window entry; once every acknowledged final of the drain is counted, write
  the window entries, then each finished marker and the deletion of its stored turns, then the
  position. A crash between them re-emits the episode on replay (same key and attempt) and never
  loses one; the window entry's recorded offset keeps a replayed final from being counted twice,
  and a replayed final of a finished episode deletes stored turns the crash left behind.
* Finals are pipelined (``rollout_bus.streams.in_flight``): ``drain()`` applies their deferred effects
  once acknowledged; until then the partition's recorded position stays before the oldest of them.
* Every record ends in exactly one outcome, counted in ``Outcomes``. Rejected records go to
  rollout.dlq, and an episode that will never be emitted (its final turn dead-lettered, unmergeable,
  or over the size limit) is abandoned: ``rollout_bus.streams.rejections``. Only errors of the record
  itself (``ValueError``s: decode, headers, validation, merge) are caught; anything else propagates.
* A turn ahead of its predecessor (``Action.HOLD``) is kept in the state (``held_turns``) and taken up
  again once the predecessor is stored; it becomes a ``gap`` dead letter only when the predecessor was
  dead-lettered for itself (a ``dead_key`` marker), or the run's end-of-run marker reaches its partition
  first (a final one then abandons its episode). Counted ``turns_held`` and ``turns_released``.
* An ``end-of-run`` control record (``control_records.EndOfRun``) on a turns partition is forwarded, once
  every in-flight episode is acknowledged, to every rollout.episodes partition with the turns
  partition it came from (``end_of_run``). Before that, every episode of the partition with stored turns and
  no final turn is dead-lettered ``unfinished`` and abandoned, its state removed (``_settle``).
* A turn on the wrong rollout.turns partition for its key is re-routed to its key's partition
  (``rollout_bus.streams.reroute`` says why and how), acknowledged before its own position moves on.
  An offline replay (``reroute=False``) holds every partition in one table: it merges a misplaced
  turn where it finds it, and the re-routed copy is then a duplicate.
* Finished markers are pruned once the partition's recorded position is ``finished_retention``
  records past their final turn (``rollout_bus.streams.finished_markers`` says why that loses nothing).
* Rebalances: ``pause()`` waits for the record in hand, drains the in-flight finals and closes the
  ``StateGate`` that ``handle`` and the timers' work wait on until ``resume()`` (``rollout_bus.streams.state_gate``
  says why: a record processed during the table's recovery could lose its state).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Any, Protocol

from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.errors import ContractError
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.partitioning import partition_for
from rollout_bus.wire.topics import Topics
from rollout_bus.streams.end_of_run import EndOfRunForwarder
from rollout_bus.streams.episode_state import EpisodeIndex
from rollout_bus.streams.finished_markers import FINISHED_RETENTION_RECORDS, FinishedMarkers
from rollout_bus.streams.in_flight import InFlight
from rollout_bus.streams.lost_records import FetchedRange, lost_ranges
from rollout_bus.streams.reroute import home_partition, reroute_turn
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.state_gate import StateGate
from rollout_bus.streams.turn_merge import TurnMerge
from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.streams.window_metrics import WindowMetrics

logger = logging.getLogger(__name__)


class Sender(Protocol):
    """Publishes one record; ``wait`` awaits the broker's acknowledgement, else the delivery
    future is returned (or None where there is no broker, as in an offline replay). ``partition``
    None partitions by key. A record over the size limit raises ``RecordTooLargeError`` (at the
    call, or from the delivery future); outages are waited out by the sender, never raised."""

    async def __call__(self, topic: str, key: bytes | None, value: bytes | None,
                       headers: list[tuple[str, bytes]], *, wait: bool,
                       partition: int | None = None) -> Awaitable[Any] | None: ...


class Fetch(Protocol):
    """Reads the records of ``topic``/``partition`` with offsets in ``[start, end)``, and where the
    partition's log starts once they are read (``lost_records.FetchedRange``)."""

    async def __call__(self, topic: str, partition: int, start: int, end: int) -> FetchedRange: ...


async def _no_fetch(topic: str, partition: int, start: int, end: int) -> FetchedRange:
    raise ContractError(f"records {start}..{end - 1} of {topic}:{partition} were skipped and cannot be read")


def position_key(partition: int) -> bytes:
    """State-table key of the next source offset to process on ``partition``."""
    return b"o|%d" % partition


class Outcomes(Counter):
    """Counts of every outcome; ``dlq.<kind>`` per dead-letter kind."""

    def summary(self) -> str:
        return " ".join(f"{name}={count}" for name, count in sorted(self.items())) or "turns_received=0"


class TurnProcessor:
    """Applies turns to the state table and publishes episodes, window metrics and dead letters: each record
    once, in order, its effects written before its position (``turns`` the turn path, ``end_of_run`` the
    control records, ``rejects`` the dead letters)."""

    def __init__(self, table: ChangelogState, send: Sender, topics: Topics, *, window_ms: int, grace_ms: int,
                 fetch: Fetch | None = None, turns_partitions: int = 1, episodes_partitions: int = 1,
                 finished_retention: int = FINISHED_RETENTION_RECORDS, reroute: bool = True,
                 reads_from_start: bool = False) -> None:
        self.table, self.send, self.topics = table, send, topics
        # a live worker owns its partitions from offset 0: a first record past it means records before it
        # were never processed (deleted, or acknowledged without being delivered); a replay from an offset does not
        self.reads_from_start = reads_from_start
        self.turns_partitions, self.episodes_partitions = turns_partitions, episodes_partitions
        self.markers = FinishedMarkers(finished_retention)
        self.reroute = reroute  # off where every partition meets in one table (an offline replay)
        self.fetch = fetch or _no_fetch
        self.gate = StateGate()  # the agent and the timers take turns on the state; a rebalance shuts them out
        self._started = time.monotonic()
        self._last_seen: dict[int, float] = {}
        self.outcomes = Outcomes()
        self.windows = WindowMetrics(table, send, topics, self.outcomes, window_ms=window_ms, grace_ms=grace_ms)
        self._in_flight = InFlight()
        self.turns = TurnMerge(table, send, topics, self.outcomes, windows=self.windows, in_flight=self._in_flight,
                               markers=self.markers)
        self.rejects = self.turns.rejects
        self.end_of_run = EndOfRunForwarder(send, topics, self.outcomes, self.rejects, settle=self._settle,
                                            turns_partitions=turns_partitions,
                                            episodes_partitions=episodes_partitions)
        self._next_offset: dict[int, int] = {}  # ahead of the recorded position until it is written
        self._written_position: dict[int, int] = {}

    def forget_partitions(self) -> None:
        """Drop cached per-partition bookkeeping (after a rebalance it is reloaded from the table)."""
        self.windows.forget()
        self._in_flight.clear()  # the new owner replays from the recorded position: nothing is lost
        self._next_offset.clear()
        self._written_position.clear()
        self.turns.forget_decoded()
        self.markers.forget()

    async def pause(self) -> None:
        """A rebalance began: finish the record in hand, apply the in-flight finals, then hold every
        record and timer until ``resume()`` (the table is being recovered under them)."""
        async with self.gate.closing():
            await self.drain()
            self.forget_partitions()

    def resume(self) -> None:
        """The rebalance and the table's recovery are complete: records flow again."""
        self.gate.open()

    async def handle(self, record: TurnRecord) -> None:
        """Process one record (and any its partition skipped) to exactly one counted outcome each."""
        async with self.gate.hold():
            self._last_seen[record.partition] = time.monotonic()
            await self._handle(record)
            self._write_positions()
            await self.table.flush()

    async def handle_batch(self, records: Sequence[TurnRecord], owned: Callable[[], Container[int]] | None = None,
                           ) -> None:
        """Process records in order, then drain their finals: the state's changelog, the window entries
        and the positions are written once per batch, not per record.

        ``owned`` (read once the gate is open) gives the rollout.turns partitions this worker holds
        now: records of others, taken before a rebalance moved them, are left to their new owner,
        which replays them from the state's recorded position.
        """
        async with self.gate.hold():
            partitions = owned() if owned is not None else None
            now = time.monotonic()
            for record in records:
                if partitions is not None and record.partition not in partitions:
                    self.outcomes["not_owned_skipped"] += 1
                    continue
                self._last_seen[record.partition] = now
                await self._handle(record)
            await self.drain()
            self._write_positions()
            await self.table.flush()

    async def drain(self) -> None:
        """Await every in-flight episode record, then apply their deferred effects in order."""
        if not self._in_flight:
            return
        counted = []
        for final, refused in await self._in_flight.settle():
            self.table.bind(final.partition)
            if refused is not None:
                await final.too_large(refused)
            else:
                final.count()
                counted.append(final)
        await self.windows.publish_counted()  # window entries before the markers: a crash never loses a count
        for final in counted:
            self.table.bind(final.partition)
            final.finish()
        self._write_positions()
        await self.table.flush()

    async def drain_idle(self) -> None:
        """The app's timer: apply acknowledged finals even when no further record arrives."""
        async with self.gate.hold():
            await self.drain()

    def _position(self, partition: int) -> int | None:
        """The next offset to process: ahead of the recorded one until the batch's end (or while finals
        are in flight)."""
        if partition in self._next_offset:
            return self._next_offset[partition]
        raw = self.table.get(position_key(partition))
        return int(raw) if raw is not None else None

    async def catch_up_idle(self, topic: str, ends: dict[int, int], idle_s: float) -> None:
        """Read what the agent never got on partitions idle for ``idle_s`` though they hold more.

        Faust may acknowledge the last records of a partition without delivering them; with no
        later record to reveal the jump, only a comparison with the partition's end finds them.
        """
        async with self.gate.hold():
            await self.drain()
            now = time.monotonic()
            for partition, end in sorted(ends.items()):
                if now - max(self._started, self._last_seen.get(partition, 0.0)) < idle_s:
                    continue
                self.table.bind(partition)
                position = self._position(partition) or 0
                if end is not None and position < end:
                    await self._read_missing(topic, partition, position, end)
            await self.drain()
            self._write_positions()
            await self.table.flush()

    async def _handle(self, record: TurnRecord) -> None:
        if self._in_flight.must_drain(record.key):
            await self.drain()
        self.table.bind(record.partition)
        expected = self._position(record.partition)
        if expected is None and self.reads_from_start:
            expected = 0
        if expected is not None and record.offset < expected:
            self.outcomes["replays_skipped"] += 1  # already processed: the state says so
            return
        if expected is not None and record.offset > expected:
            await self._read_missing(record.topic, record.partition, expected, record.offset)
        await self._process(record)

    async def _read_missing(self, topic: str, partition: int, start: int, end: int) -> None:
        """Read and process records ``[start, end)``, which Faust acknowledged without delivering.

        Faust acks the messages it skips around a rebalance or a restart; the state's position
        notices, and every record is then processed at least once all the same. Offsets the partition
        no longer holds (its log start moved past them) are lost: each run is said once, dead-lettered
        as ``lost``, and the position moves past it, so the worker never waits for them.
        """
        logger.warning("partition=%d: records %d..%d were never delivered to the agent; reading them",
                       partition, start, end - 1)
        fetched = await self.fetch(topic, partition, start, end)
        lost = lost_ranges(start, end, fetched)
        for first, count in lost:
            await self.rejects.lost(topic, partition, first, count, fetched.log_start)
        self.table.bind(partition)
        self.outcomes["catch_ups"] += 1
        self.outcomes["records_caught_up"] += len(fetched.records)
        for skipped in fetched.records:
            await self._process(skipped)
        if lost:
            after_lost = lost[-1][0] + lost[-1][1]
            self._next_offset[partition] = max(self._next_offset.get(partition, start), after_lost)
        self.table.bind(partition)

    async def _process(self, record: TurnRecord) -> None:
        """The record's outcome, the windows it made due, then its position (the caller flushes the state)."""
        self.windows.of(record.partition).observe(record.timestamp_ms)
        control = control_kind(record.headers)
        home = home_partition(record, self.turns_partitions) if control is None and self.reroute else None
        if home is not None:
            await self._reroute(record, home)
        elif control is None:
            await self.turns.turn(record)
        else:
            await self.end_of_run.handle(record, control)
        await self._close_due(record.partition)
        self._next_offset[record.partition] = record.offset + 1

    def _write_positions(self) -> None:
        """Record each partition's next offset, written last for what the state holds of it; a partition
        with finals in flight keeps the position it had before the oldest of them until they are drained."""
        held = self._in_flight.partitions()
        for partition in sorted(p for p in self._next_offset if p not in held):
            position = self._next_offset[partition]
            if position != self._written_position.get(partition):
                self.table.bind(partition)
                self.table[position_key(partition)] = b"%d" % position
                self._written_position[partition] = position
                self.turns.prune_finished(partition, position)

    async def _reroute(self, record: TurnRecord, home: int) -> None:
        """Send a misplaced turn on to its key's partition, where the worker owning its episode merges it."""
        self.outcomes["turns_received"] += 1
        reason = await reroute_turn(record, home, self.turns_partitions, self.send)
        if reason is None:
            self.outcomes["turns_rerouted"] += 1
        else:
            await self.rejects.dead_letter(record, DlqKind.PARTITION, reason)

    async def _settle(self, marker: TurnRecord) -> None:
        """Before an end-of-run marker is forwarded: the turns held on its partition are decided for the last
        time, every in-flight episode is acknowledged, then every episode of the partition still without its
        final turn is dead-lettered ``unfinished`` and abandoned."""
        self.table.bind(marker.partition)
        await self.turns.expire_held(marker.partition)
        await self.drain()
        self.table.bind(marker.partition)
        await self.turns.settle_unfinished(marker, self._settles_on)
        self.table.bind(marker.partition)

    def _settles_on(self, key: bytes, index: EpisodeIndex) -> int:
        """The partition whose end-of-run marker ends an open episode: its key's (every turn of it is processed
        there, re-routed if need be), or where one table holds every partition (no re-routing), the one its
        last turn was stored from."""
        return partition_for(key, self.turns_partitions) if self.reroute else index.partition

    async def _close_due(self, partition: int) -> None:
        """Close the windows the watermark passed; in-flight finals are counted in their windows first."""
        if self._in_flight and self.windows.any_due(partition):
            await self.drain()
            self.table.bind(partition)
        await self.windows.close_due(partition)
