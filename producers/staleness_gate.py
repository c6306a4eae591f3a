"""The staleness bound, enforced where it is cheap: a group is not started until its weights are fresh enough.

Why: in asynchronous RL the generators run ahead of the trainer, and an episode sampled under weights
many steps old is off-policy enough to hurt training. Filtering stale episodes after the fact wastes
the compute that generated them; holding back the *start* of work that would end up too stale (AReaL's
``max_head_offpolicyness``) costs nothing but the wait. The bound follows from the group index alone
(step batching: batch k holds group indices ``[k*G, (k+1)*G)`` and trains at trainer step k; after it
the trainer publishes version k+1), so any number of generators enforce it with no coordination beyond
reading rollout.weights.

Contract:

* ``StalenessGate(watcher, run, *, on_wait=None, stop=None)``; ``watcher`` is anything with ``version``,
  ``refresh()`` and ``wait_for(min_version, timeout_s=, on_wait=, stop=)``
  (``rollout_bus.consumers.feed.weights.WeightWatcher``); ``run`` is the run's batching
  (``rollout_bus.wire.run_record.RunBatching``: ``max_staleness`` and the rule ``batch_of``, checked when built).
* ``admit(group_index)`` returns the live version once it is at least ``required(group_index)`` =
  ``run.batch_of(group_index) - max_staleness``; it returns at once when ``max_staleness`` is
  None (no bound) or the version is already there. ``max_staleness=0`` is synchronous RL: batch k
  starts only under version k.
* While it waits it says why, the same words on the log (INFO, once when the wait begins, then every
  time the watcher reports, about every 10 s) and to ``on_wait`` (a ``GateWait``; ``on_wait(None)``
  once the group is admitted)::

      waiting for weights version 2 (live 1) before group 12 of batch 3, max staleness 1

* ``stop()`` True (a SIGTERM) raises ``rollout_bus.errors.Stopped``: at the next ``admit`` (between
  groups, never mid-group) or during a wait (within a poll of the watcher, 200 ms).
* ``held(group_index)`` is the same question without waiting (the prompt-fed member asks it from its own loop,
  so a group that must wait takes no worker slot and never holds back a lower group): the ``GateWait`` that
  keeps the group back under the live version (refreshed), or None when it may start; ``admitted(...)`` (how
  long it was held) counts it among ``waits``/``waited_s`` and says so.
* ``current()`` is the live version, refreshed without waiting: it stamps each engine call.
  ``lowest``/``highest`` are the least and greatest live versions the gate handed out (None before any).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rollout_bus.errors import Stopped
from rollout_bus.wire.run_record import RunBatching

logger = logging.getLogger(__name__)


class VersionSource(Protocol):
    """What the gate needs of a ``WeightWatcher``."""

    @property
    def version(self) -> int: ...

    def refresh(self) -> int: ...

    def wait_for(self, min_version: int, *, timeout_s: float | None = None,
                 on_wait: Callable[[int, int, float], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> int: ...


@dataclass(frozen=True)
class GateWait:
    """Why a group is held back: the version it needs, the live one, and for how long so far."""

    group_index: int
    batch: int
    need: int
    live: int
    max_staleness: int
    waited_s: float = 0.0

    def describe(self) -> str:
        return (f"waiting for weights version {self.need} (live {self.live}) before group {self.group_index} "
                f"of batch {self.batch}, max staleness {self.max_staleness}")


GateWaitFn = Callable[[GateWait | None], None]


class StalenessGate:
    """Admission control of prompt groups by the trainer's live weight version."""

    def __init__(self, watcher: VersionSource, run: RunBatching, *, on_wait: GateWaitFn | None = None,
                 stop: Callable[[], bool] | None = None) -> None:
        self.watcher = watcher
        self.run = run
        self.max_staleness = run.max_staleness
        self.on_wait = on_wait
        self.stop = stop
        self.lowest: int | None = None
        self.highest: int | None = None
        self.waits = 0
        self.waited_s = 0.0

    def batch_of(self, group_index: int) -> int:
        return self.run.batch_of(group_index)

    def required(self, group_index: int) -> int | None:
        """The least live version under which the group may start (None: no bound)."""
        if self.max_staleness is None:
            return None
        return self.batch_of(group_index) - self.max_staleness

    def current(self) -> int:
        """The live version, refreshed without waiting."""
        return self._seen(self.watcher.refresh())

    def held(self, group_index: int) -> GateWait | None:
        """What keeps the group from starting under the live version (refreshed, no wait), or None."""
        need, live = self.required(group_index), self.current()
        if need is None or live >= need:
            return None
        return GateWait(group_index, self.batch_of(group_index), need, live, self.max_staleness)

    def admitted(self, group_index: int, waited_s: float) -> None:
        """A group ``held`` for ``waited_s`` seconds starts now: counted and said, as ``admit`` does."""
        self.waits += 1
        self.waited_s += waited_s
        logger.info("admitted group %d of batch %d under weights version %d after waiting %.1fs", group_index,
                    self.batch_of(group_index), self.watcher.version, waited_s)
        if self.on_wait is not None:
            self.on_wait(None)

    def admit(self, group_index: int) -> int:
        """The live version, once the group may start (see the module docstring)."""
        batch = self.batch_of(group_index)
        if self.stop is not None and self.stop():
            raise Stopped(f"stopped before group {group_index} of batch {batch}")
        live = self.current()
        bound = self.max_staleness
        if bound is None or live >= batch - bound:
            return live
        need = batch - bound
        began = time.monotonic()
        self._say(GateWait(group_index, batch, need, live, bound))

        def still_waiting(version: int, min_version: int, waited_s: float) -> None:
            self._say(GateWait(group_index, batch, min_version, version, bound, waited_s))

        try:
            live = self.watcher.wait_for(need, on_wait=still_waiting, stop=self.stop)
        finally:
            self.waits += 1
            self.waited_s += time.monotonic() - began
        logger.info("admitted group %d of batch %d under weights version %d after waiting %.1fs", group_index,
                    batch, live, time.monotonic() - began)
        if self.on_wait is not None:
            self.on_wait(None)
        return self._seen(live)

    def _say(self, wait: GateWait) -> None:
        if wait.waited_s:
            logger.info("%s (waited %.0fs)", wait.describe(), wait.waited_s)
        else:
            logger.info("%s", wait.describe())
        if self.on_wait is not None:
            self.on_wait(wait)

    def _seen(self, version: int) -> int:
        self.lowest = version if self.lowest is None else min(self.lowest, version)
        self.highest = version if self.highest is None else max(self.highest, version)
        return version
