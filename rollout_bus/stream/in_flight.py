"""Finals whose episode records are sent but not yet known to be acknowledged.

Why: awaiting each episode record before the next turn would hold a worker to one broker round trip
per episode, and awaiting a batch's episode records before the next batch idled the worker for a round
trip per batch (~10% of its time at full speed). Finals are pipelined instead: the worker goes on with
other records, and batches, while episode records are in flight. The processor applies the deferred
effects of the finals already acknowledged, oldest first, at the end of each batch and on the app's short
timer (``settle(wait=False)``), and waits for all of them before any record of an in-flight episode's key,
before a window closes, at ``MAX_IN_FLIGHT``, before an end-of-run is forwarded and on a rebalance.
Meanwhile a partition's recorded position is at most the offset of its oldest in-flight final
(``oldest()``), so a crash replays from there (the later records' effects are idempotent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollout_bus.errors import RecordTooLargeError

MAX_IN_FLIGHT = 256  # finals whose episode records may be unacknowledged at once


@dataclass
class Final:
    """A final whose episode record is sent; ``count`` then ``finish`` run once the broker acknowledges
    it, ``too_large`` instead when the broker refuses the record for its size."""

    partition: int
    key: bytes
    offset: int  # of the final turn record: the partition's recorded position stays at or before it
    delivery: Awaitable[Any] | None
    count: Callable[[], None]  # into its window entry (written once per drain, before any finished marker)
    finish: Callable[[], None]  # the finished marker; the stored turns forgotten
    too_large: Callable[[BaseException], Awaitable[None]]


class InFlight:
    """The finals in flight, in the order they were sent."""

    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        self.limit = limit
        self._finals: list[Final] = []
        self._keys: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._finals)

    def add(self, final: Final) -> None:
        self._finals.append(final)
        self._keys.add(final.key)

    def must_drain(self, key: bytes | None) -> bool:
        """Whether to drain before a record of ``key``: one of its episodes is in flight, or the pipeline is full."""
        return key in self._keys or len(self._finals) >= self.limit

    def oldest(self) -> dict[int, int]:
        """Per source partition with finals in flight, the offset of the oldest: its position may not pass it."""
        found: dict[int, int] = {}
        for final in self._finals:
            found.setdefault(final.partition, final.offset)
        return found

    def clear(self) -> None:
        self._finals.clear()
        self._keys.clear()

    async def settle(self, wait: bool = True) -> list[tuple[Final, RecordTooLargeError | None]]:
        """Take every final (``wait=False``: the oldest ones whose deliveries are complete, up to the first that
        is not) and await their deliveries together: each final in order, with the size refusal of its record
        or None. Any other failed delivery is raised (the worker crashes and replays)."""
        if wait:
            finals, self._finals = self._finals, []
        else:
            done = 0
            while done < len(self._finals) and (self._finals[done].delivery is None
                                                or _complete(self._finals[done].delivery)):
                done += 1
            finals, self._finals = self._finals[:done], self._finals[done:]
        self._keys = {final.key for final in self._finals}
        sent = [f for f in finals if f.delivery is not None]
        results = dict(zip(map(id, sent), await asyncio.gather(*(f.delivery for f in sent), return_exceptions=True)))
        for result in results.values():
            if isinstance(result, BaseException) and not isinstance(result, RecordTooLargeError):
                raise result
        refused = {key: result for key, result in results.items() if isinstance(result, RecordTooLargeError)}
        return [(final, refused.get(id(final))) for final in finals]


def _complete(delivery: Awaitable[Any]) -> bool:
    """Whether a delivery has its outcome (a future or task that is done; any other awaitable is awaited)."""
    done = getattr(delivery, "done", None)
    return bool(done()) if callable(done) else False
