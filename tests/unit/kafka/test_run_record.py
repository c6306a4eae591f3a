"""Declaring the run's batching waits out a broker that is away, then declares once (no broker: fakes)."""

from types import SimpleNamespace

from rollout_bus.errors import Unavailable
from rollout_bus.kafka import run_record
from rollout_bus.wire.run_record import RUN_BATCHING_KEY, RunBatching
from rollout_bus.wire.topics import Topics


def test_a_stalled_read_is_retried_and_the_declaration_is_sent_once(monkeypatch):
    log: list = []
    ours = RunBatching(4, "step", 1, "shard writer@h:1")

    def read_topic(conn, topic, *, stall_s):
        log.append(("read", topic, stall_s))
        if sum(entry[0] == "read" for entry in log) == 1:  # the first read stalls: the broker is away
            raise Unavailable("no record from rollout.run for 10s before their end offsets")
        sent = [entry for entry in log if entry[0] == "sent"]
        return [SimpleNamespace(key=RUN_BATCHING_KEY, value=ours.value(), partition=0, offset=0)] if sent else []

    class Producer:
        def send(self, topic, *, key, value, partition):
            log.append(("sent", topic, key, value, partition))
            return SimpleNamespace(get=lambda timeout: None)

        def close(self):
            pass

    monkeypatch.setattr(run_record, "read_topic", read_topic)
    monkeypatch.setattr(run_record, "ensure_topics", lambda conn, topics, only: log.append(("ensure", only)))
    monkeypatch.setattr(run_record, "new_producer", lambda conn, acks: Producer())
    topics = Topics(prefix="p.")
    assert run_record.check_run_batching({"bootstrap_servers": "x"}, topics, ours, timeout_s=3.0) == ours
    kinds = [entry[0] for entry in log]
    assert kinds == ["ensure", "read", "ensure", "read", "sent", "read"], log
    assert ("sent", "p.rollout.run", RUN_BATCHING_KEY, ours.value(), 0) in log
    assert all(entry[2] == 3.0 for entry in log if entry[0] == "read")
