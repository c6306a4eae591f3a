"""Finals whose episode records are sent but not yet known to be acknowledged.

Why: awaiting each episode record before the next turn would hold a worker to one broker round trip
per episode. Finals are pipelined instead: the worker goes on with other records while episode records
are in flight, and the processor's ``drain()`` applies their deferred effects once they are
acknowledged (at the end of each batch, before any record of an in-flight episode's key, before a
window closes, at ``MAX_IN_FLIGHT``, and on the app's short timer). Until then the partition's recorded
position stays where it was before the oldest in-flight final, so a crash replays from there (the later
records' effects are idempotent).
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

    def partitions(self) -> set[int]:
        """The source partitions whose positions wait for a final in flight."""
        return {final.partition for final in self._finals}

    def clear(self) -> None:
        self._finals.clear()
        self._keys.clear()

    async def settle(self) -> list[tuple[Final, RecordTooLargeError | None]]:
        """Take every final and await their deliveries together: each final in order, with the size
        refusal of its record or None. Any other failed delivery is raised (the worker crashes and replays)."""
        finals, self._finals = self._finals, []
        self._keys.clear()
        sent = [f for f in finals if f.delivery is not None]
        results = dict(zip(map(id, sent), await asyncio.gather(*(f.delivery for f in sent), return_exceptions=True)))
        for result in results.values():
            if isinstance(result, BaseException) and not isinstance(result, RecordTooLargeError):
                raise result
        refused = {key: result for key, result in results.items() if isinstance(result, RecordTooLargeError)}
        return [(final, refused.get(id(final))) for final in finals]
