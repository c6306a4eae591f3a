"""Who may touch the stream state, and when: one holder at a time, nobody during a rebalance.

The agent (one record at a time) and the app's timers (catch-up reads, draining acknowledged
finals) take turns through ``hold()``. ``close()`` waits for the current holder, then keeps
everyone out until ``open()``: Faust recovers the in-memory table by replaying its changelog over
the live table, so anything written meanwhile could be overwritten by an older value.

Contract: ``async with gate.hold():`` runs its body alone and only while the gate is open;
``async with gate.closing():`` closes the gate once the current holder is done and runs its
body (what must happen before the recovery: drain, forget) while holding the state; ``open()``
lets the waiting holders in again. Closing an already closed gate is harmless.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StateGate:
    """A lock on the state, and a gate in front of it that a rebalance keeps closed."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the state, once no rebalance keeps the gate closed."""
        while True:
            await self._open.wait()
            await self._lock.acquire()
            if self._open.is_set():
                break
            self._lock.release()
        try:
            yield
        finally:
            self._lock.release()

    @asynccontextmanager
    async def closing(self) -> AsyncIterator[None]:
        """Wait for the current holder, close the gate, and hold the state for the body."""
        async with self._lock:
            self._open.clear()
            yield

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()
