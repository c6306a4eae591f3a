"""The stream worker says when the broker stops answering (a dropped-packet partition) and when it is back."""

from __future__ import annotations

import asyncio
import logging

from rollout_bus.streams.broker_watch import BrokerWatch


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_probe_that_hangs_is_said_at_once_then_every_interval_and_the_return_is_said_once(caplog):
    clock, answering = _Clock(), {"up": False}

    async def probe():
        if not answering["up"]:
            await asyncio.sleep(3600)  # packets dropped: the request never completes

    watch = BrokerWatch(probe, "10.0.0.9:9092", timeout_s=0.01, log_every_s=10.0, clock=clock,
                        why=lambda servers: f"{servers} does not answer a TCP connect")
    caplog.set_level(logging.WARNING, logger="rollout_bus.streams.broker_watch")

    async def go():
        results = []
        for step in (0.0, 5.0, 6.0, 30.0):  # at 100, 105, 111, 141
            clock.now += step
            results.append(await watch.check())
        answering["up"] = True
        clock.now += 4.0
        results.append(await watch.check())
        results.append(await watch.check())
        return results

    assert asyncio.run(go()) == [False, False, False, False, True, True]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "waiting for broker: no answer from bootstrap_servers=10.0.0.9:9092 for 0s (TimeoutError): "
        "10.0.0.9:9092 does not answer a TCP connect",
        "waiting for broker: no answer from bootstrap_servers=10.0.0.9:9092 for 11s (TimeoutError): "
        "10.0.0.9:9092 does not answer a TCP connect",
        "waiting for broker: no answer from bootstrap_servers=10.0.0.9:9092 for 41s (TimeoutError): "
        "10.0.0.9:9092 does not answer a TCP connect",
        "broker answers again after 45s (bootstrap_servers=10.0.0.9:9092)"], lines
    assert watch.outages == 1


def test_a_probe_that_fails_fast_is_an_outage_too_and_a_healthy_broker_logs_nothing(caplog):
    async def refused():
        raise ConnectionRefusedError("refused")

    async def fine():
        return None

    caplog.set_level(logging.WARNING, logger="rollout_bus.streams.broker_watch")
    assert asyncio.run(BrokerWatch(fine, "h:1", why=str).check()) is True
    assert caplog.records == []
    assert asyncio.run(BrokerWatch(refused, "h:1", why=lambda s: "refuses").check()) is False
    assert "(ConnectionRefusedError: refused): refuses" in caplog.records[0].getMessage()
