"""Re-routing a turn that arrived on the wrong rollout.turns partition for its key.

Why: every turn of an episode must reach the worker holding its state, but not every producer puts
a key where Kafka's default murmur2 partitioner does (librdkafka's default is CRC32-based; WIRE.md
section 3). Merging a misplaced turn where it landed would split its episode between two workers,
so it is sent on instead: the same key, value and headers, plus ``rerouted-from``
(``topic:partition:offset``), to ``partitioning.partition_for(key)``, acknowledged before the
processor moves its position past it; a crash re-sends it and the copy is ignored there as a
duplicate turn. A record already re-routed once and still misplaced (the partition count changed
under it), or too large to copy, is dead-lettered (kind ``partition``) rather than sent round again.
Only well-formed rollout keys are re-routed; any other record is judged where it is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_bus.errors import ContractError, RecordTooLargeError
from rollout_bus.streams.turn_record import TurnRecord
from rollout_bus.wire.headers import HEADER_REROUTED_FROM
from rollout_bus.wire.partitioning import partition_for
from rollout_bus.wire.rollout_key import parse_rollout_key

logger = logging.getLogger(__name__)


def home_partition(record: TurnRecord, partitions: int) -> int | None:
    """The partition a turn belongs on when it is not there; None when it is, or when its key is no
    rollout key (such a record takes the usual path to its outcome where it is)."""
    if record.key is None:
        return None
    home = partition_for(record.key, partitions)
    if home == record.partition:
        return None
    try:
        parse_rollout_key(record.key)
    except ContractError:
        return None
    return home


def rerouted_headers(record: TurnRecord) -> list[tuple[str, bytes]]:
    """The copy's headers: the original's, in order, plus where it was found."""
    return [*record.headers, (HEADER_REROUTED_FROM, record.source.encode())]


def loop_reason(record: TurnRecord, home: int, partitions: int) -> str | None:
    """Why a misplaced turn is not sent round again (it was re-routed once already), else None."""
    if not any(name == HEADER_REROUTED_FROM for name, _ in record.headers):
        return None
    return (f"re-routed once already and still not on partition {home} of {partitions}, the one "
            f"murmur2 of its key gives (did the topic's partition count change?)")


async def reroute_turn(record: TurnRecord, home: int, partitions: int,
                       send: Callable[..., Awaitable[Any]]) -> str | None:
    """Send a misplaced turn on to ``home`` and await its acknowledgement; None once it is there, else
    the reason to dead-letter it (kind ``partition``) instead."""
    reason = loop_reason(record, home, partitions)
    if reason is not None:
        return reason
    try:
        await send(record.topic, record.key, record.value, rerouted_headers(record), wait=True, partition=home)
    except RecordTooLargeError as exc:
        return (f"on partition {record.partition}, not {home} as murmur2 of its key gives, and too large to "
                f"re-route: {exc}")
    logger.info("re-routed %s to partition %d (its key's under murmur2; was the producer's partitioner "
                "murmur2?)", record.source, home)
    return None
