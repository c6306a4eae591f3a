"""Several inference engines behind one prompt-fed generator: a request to one that dies goes to another.

Why: a fleet loses engines every hour (a node drained, a process OOM-killed, a rolling restart). A generator
given several (``--engine-url`` more than once) keeps its episodes going on the others instead of failing
the delivery of every prompt group in flight on the dead one; an engine that answers 4xx is not one that
died: the request itself is wrong (its sampling, its length, an adapter the fleet lacks), so it goes
nowhere else and its reason goes up (to the log, and with the failed delivery to the DLQ).

Contract:

* ``EnginePool(urls, timeout_s=120, down_s=10, clock=time.monotonic)``; ``post(path, body)`` sends to one
  engine and returns its parsed answer, taking the engines in turn (each call starts after the one the last
  call used, so calls spread over the pool), skipping those marked down within the last ``down_s`` seconds
  (with every engine down, all are tried anyway, in turn). An engine that does not answer, or answers 5xx
  (``EngineError``), is marked down, said once as a WARNING naming it and the engine tried next, and the
  same request goes to the next engine; an ``EngineRefused`` (4xx) is raised at once, no other engine asked.
  When every engine failed, an ``EngineError`` names each and why.
* ``base_url``: the URLs, for messages; ``urls`` as given (trailing ``/`` dropped). Thread-safe: the member's
  worker threads share one pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_bus.errors import ConfigError, EngineError, EngineRefused
from rollout_bus.producers.engine_client import EngineClient

logger = logging.getLogger(__name__)


def engine_urls(value: str | Sequence[str]) -> list[str]:
    """``--engine-url`` given once or more, each possibly comma-separated, as a list (``ConfigError`` if empty)."""
    parts = [value] if isinstance(value, str) else list(value)
    urls = [url.strip().rstrip("/") for part in parts for url in str(part).split(",") if url.strip()]
    if not urls:
        raise ConfigError("--engine-url: no engine URL given")
    return urls


class EnginePool:
    """JSON over HTTP to the first engine of the pool that answers (see the module docstring)."""

    def __init__(self, urls: str | Sequence[str], *, timeout_s: float = 120.0, down_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.urls = engine_urls(urls)
        self.clients = [EngineClient(url, timeout_s=timeout_s) for url in self.urls]
        self.down_s, self.clock = float(down_s), clock
        self.down_until = [0.0] * len(self.urls)
        self.next = 0
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return self.urls[0] if len(self.urls) == 1 else "{" + ", ".join(self.urls) + "}"

    def _order(self) -> list[int]:
        with self.lock:
            start, self.next = self.next, (self.next + 1) % len(self.urls)
            now = self.clock()
            turn = [(start + i) % len(self.urls) for i in range(len(self.urls))]
            up = [i for i in turn if self.down_until[i] <= now]
            return up + [i for i in turn if i not in up]

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        if len(self.clients) == 1:
            return self.clients[0].post(path, body)
        failures: list[str] = []
        order = self._order()
        for n, i in enumerate(order):
            try:
                return self.clients[i].post(path, body)
            except EngineRefused:
                raise
            except EngineError as exc:
                failures.append(str(exc))
                with self.lock:
                    was_up = self.down_until[i] <= self.clock()
                    self.down_until[i] = self.clock() + self.down_s
                if n + 1 < len(order) and was_up:
                    logger.warning("engine %s failed (%s): the request goes to %s; it is passed over for %.0fs",
                                   self.urls[i], exc, self.urls[order[n + 1]], self.down_s)
        raise EngineError(f"every engine failed this request: {'; '.join(failures)}")
