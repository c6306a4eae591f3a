"""Saying that the broker stopped answering the stream worker, and when it answers again.

Why: a network partition that drops packets (rather than refusing them) leaves aiokafka waiting on its
requests without a word: the other stages log ``waiting for broker ...`` lines, the stream worker logged
nothing for the whole outage, then only aiokafka's ``Timer commit is overlapping`` and ``UnknownMemberId``.
A probe of its own (a metadata request with a deadline, made by the app on a timer) tells it apart.

Contract: ``BrokerWatch(probe, servers).check()`` runs ``probe()`` under ``timeout_s``. While probes fail,
it logs one WARNING line every ``log_every_s`` (the first at the first failure): ``waiting for broker: no
answer from bootstrap_servers=... for Ns: <why>``, the why from ``kafka.reachability.diagnose`` (run off
the event loop); the first probe that answers after that logs ``broker answers again after Ns``. It never
raises, and counts the outages in ``outages``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rollout_bus.kafka.reachability import diagnose

logger = logging.getLogger(__name__)


class BrokerWatch:
    """One probe per ``check()``; says when answers stop and start again (see the module docstring)."""

    def __init__(self, probe: Callable[[], Awaitable[object]], servers: str, *, timeout_s: float = 5.0,
                 log_every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 why: Callable[[str], str] = diagnose) -> None:
        self.probe, self.servers = probe, servers
        self.timeout_s, self.log_every_s = timeout_s, log_every_s
        self.clock, self.why = clock, why
        self.outages = 0
        self._since: float | None = None
        self._last_log: float | None = None

    async def check(self) -> bool:
        """Probe once; True when the broker answered."""
        began = self.clock()
        try:
            await asyncio.wait_for(self.probe(), self.timeout_s)
        except Exception as exc:  # a timeout, a connection error: the broker did not answer
            await self._not_answering(began, exc)
            return False
        if self._since is not None:
            logger.warning("broker answers again after %.0fs (bootstrap_servers=%s)", self.clock() - self._since,
                           self.servers)
            self._since = self._last_log = None
        return True

    async def _not_answering(self, began: float, exc: BaseException) -> None:
        if self._since is None:
            self._since = began
            self.outages += 1
        now = self.clock()
        if self._last_log is not None and now - self._last_log < self.log_every_s:
            return
        self._last_log = now
        reason = await asyncio.get_running_loop().run_in_executor(None, self.why, self.servers)
        what = type(exc).__name__ if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
        logger.warning("waiting for broker: no answer from bootstrap_servers=%s for %.0fs (%s): %s", self.servers,
                       now - self._since, what, reason)
