"""Control records on rollout.turns: an end-of-run marker is forwarded to every rollout.episodes partition.

Why: the shard writer reads rollout.episodes partitions, not rollout.turns ones; a run's end reaches it only
as a marker on each episodes partition, and a reader that sees the marker must have seen every episode of the
turns partition it came from.

Contract: ``EndOfRunForwarder.handle(record, control)`` counts ``control_records``. An ``end-of-run``
record (``control_records.EndOfRun``) first settles its partition (``settle(record)``: the processor
decides the turns still held there for the last time, awaits every in-flight episode, then dead-letters and
abandons every episode of the partition still without its final turn, ``unfinished``), then goes to
every rollout.episodes partition, each send acknowledged, with the turns partition it came from
(``EndOfRun.forwarded``), counted ``end_of_run_forwarded``. Any other control kind, or a marker that does
not parse, is a ``control`` dead letter.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_bus.errors import ContractError
from rollout_bus.streams.rejections import Rejections
from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.wire.control_records import END_OF_RUN_KEY, EndOfRun
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.headers import CONTROL_END_OF_RUN
from rollout_bus.wire.topics import Topics

logger = logging.getLogger(__name__)


class EndOfRunForwarder:
    """The control records of rollout.turns, over a processor's sender, outcome counts and rejections."""

    def __init__(self, send: Any, topics: Topics, outcomes: Counter, rejects: Rejections, *, turns_partitions: int,
                 episodes_partitions: int, settle: Callable[[TurnRecord], Awaitable[None]]) -> None:
        self.send, self.topics, self.outcomes, self.rejects = send, topics, outcomes, rejects
        self.turns_partitions, self.episodes_partitions = turns_partitions, episodes_partitions
        self.settle = settle

    async def handle(self, record: TurnRecord, control: str) -> None:
        """An end-of-run marker is forwarded to every rollout.episodes partition, after every
        episode of its partition is acknowledged (so a reader that sees it has seen them all)."""
        self.outcomes["control_records"] += 1
        if control != CONTROL_END_OF_RUN:
            await self.rejects.dead_letter(record, DlqKind.CONTROL, f"control record {control!r} is not one "
                                                                    f"rollout.turns carries (expected "
                                                                    f"{CONTROL_END_OF_RUN!r})")
            return
        try:
            marker = EndOfRun.from_value(record.value)
        except ContractError as exc:
            await self.rejects.dead_letter(record, DlqKind.CONTROL, str(exc))
            return
        await self.settle(record)
        forwarded = marker.forwarded(record.partition, self.turns_partitions)
        for partition in range(self.episodes_partitions):
            await self.send(self.topics.episodes, END_OF_RUN_KEY, forwarded.value(), forwarded.headers(), wait=True,
                            partition=partition)
        self.outcomes["end_of_run_forwarded"] += 1
        logger.info("end of run run=%s partition=%d offset=%d forwarded to %d episode partitions", marker.run,
                    record.partition, record.offset, self.episodes_partitions)
