"""TopicWatcher: an end-offsets request that never returns (kafka-python 3 was seen to block for minutes past
its request timeout) is abandoned after the bound, its client replaced, and the last counts kept."""

from __future__ import annotations

import logging
import threading

from rollout_bus.kafka import reader
from rollout_bus.kafka.reader import TopicWatcher

TOPIC = "run.rollout.turns"


class Client:
    """A group-less consumer: end offsets answered from ``ends``, or never (``hang``)."""

    made: list["Client"] = []

    def __init__(self, hang: bool):
        self.hang, self.closed, self.released = hang, False, threading.Event()
        Client.made.append(self)

    def end_offsets(self, partitions):
        if self.hang:
            self.released.wait(30)  # a request that does not come back (released at the test's end)
        return {tp: 7 for tp in partitions}

    def assign(self, partitions):
        pass

    def seek_to_beginning(self, *partitions):
        pass

    def close(self):
        self.closed = True


def test_a_request_that_never_returns_is_abandoned_and_the_next_one_asks_a_new_client(monkeypatch, caplog):
    hangs = iter([False, False, False])  # the reader, the first end-offset client, the one replacing it
    Client.made = []
    monkeypatch.setattr(reader, "group_less_consumer", lambda conn, **kw: Client(next(hangs)))
    monkeypatch.setattr(reader, "wait_for_partitions", lambda consumer, topic: [0, 1])
    watcher = TopicWatcher({"bootstrap_servers": "x"}, [TOPIC], [])
    watcher.ends_bound_s = 0.2
    assert watcher.counts() == {TOPIC: 14}
    watcher._ender.close()
    watcher._ender = Client(True)  # the end-offset client's next request never returns
    stuck = watcher._ender
    with caplog.at_level(logging.WARNING, logger="rollout_bus.kafka.reader"):
        assert watcher.counts() == {TOPIC: 14}  # the last counts, after the bound, not a hang
    assert watcher.replaced == 1 and "not answered in 0s" in caplog.records[0].getMessage()
    assert watcher.counts() == {TOPIC: 14} and watcher._ender is not stuck  # a new client answered ...
    assert watcher.replaced == 1 and len(Client.made) == 4  # ... at once: nothing abandoned again
    stuck.released.set()
    watcher.close()
    assert all(c.closed for c in Client.made if c is not stuck)
