"""The generator's producer rides out a broker outage of over two minutes: nothing lost, nothing doubled, in order.

Slow (about four minutes): marked ``chaos``, excluded from the default run; ``pytest -m chaos`` runs it.
It needs a broker it may stop, so it starts its own on a private port with ``rollout-bus kafka start``
(the shared test broker is never touched) and stops it at the end.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_bus.producers.publisher import TurnPublisher
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.local_kafka.local_cluster import free_ports
from rollout_bus.wire.topics import Topics
from tests.integration.test_publisher import read_all

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
OUTAGE_S = 130.0
KEYS = [f"episode-{i}".encode() for i in range(12)]


def kafka(action: str, port: int, data_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", "kafka", action, "--port", str(port),
                           "--data-dir", str(data_dir)], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"kafka {action}: {done.stdout}{done.stderr}"


@pytest.fixture
def own_broker(tmp_path):
    port, data_dir = free_ports(1)[0], tmp_path / "kafka"
    kafka("start", port, data_dir)
    try:
        yield port, data_dir
    finally:
        kafka("stop", port, data_dir)


def test_publishing_through_a_two_minute_broker_outage_delivers_every_record_once_in_order(own_broker, caplog):
    port, data_dir = own_broker
    bootstrap = f"127.0.0.1:{port}"
    topics = Topics(prefix="outage.")
    ensure_topics({"bootstrap_servers": bootstrap}, topics)
    caplog.set_level(logging.INFO, logger="rollout_bus.producers")
    waits: list = []
    sent: list[int] = []
    errors: list[BaseException] = []
    publisher = TurnPublisher(bootstrap, topic=topics.turns, on_wait=waits.append)

    def send(seq: int) -> None:
        publisher.send_raw(KEYS[seq % len(KEYS)], str(seq).encode(), [("seq", str(seq).encode())])
        sent.append(seq)

    for seq in range(200):
        send(seq)
    publisher.flush()
    kafka("stop", port, data_dir)
    stopped = time.monotonic()
    stop_publishing = threading.Event()

    def keep_publishing() -> None:
        try:
            seq = len(sent)
            while not stop_publishing.is_set():
                send(seq)
                seq += 1
                time.sleep(0.25)
            publisher.flush()  # blocks until the broker is back and has every record
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=keep_publishing, daemon=True)
    thread.start()
    while time.monotonic() - stopped < OUTAGE_S:
        time.sleep(1.0)
        assert thread.is_alive() or errors, "the publisher stopped during the outage"
        assert not errors, errors
    stop_publishing.set()  # the flush after this still has to wait for the broker
    kafka("start", port, data_dir)
    thread.join(timeout=400)
    assert not thread.is_alive(), "the flush never completed after the broker came back"
    assert not errors, errors
    publisher.close()

    records = read_all({"bootstrap_servers": bootstrap}, topics.turns, len(sent), timeout_s=120.0)
    seqs = [int(r.value) for r in records]
    assert sorted(seqs) == sent == list(range(len(sent))), "a record was lost or doubled"
    assert len(sent) > 200 + OUTAGE_S / 0.25 * 0.8
    for key in KEYS:
        mine = [int(r.value) for r in records if r.key == key]
        assert mine == sorted(mine), f"records of {key!r} out of order"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "waiting for broker" in r.getMessage()]
    assert len(warnings) >= OUTAGE_S / 10 - 3, warnings
    assert any(w is not None and w.records > 0 for w in waits) and waits[-1] is None
