"""SLOW (about 70 s, its own broker): the shard writer rides out a broker outage longer than kafka-python's
default timeouts (30 s requests, 60 s max_block), then writes what was produced after the broker came back.

The suite's shared broker is never stopped: this test starts a private one (``rollout-bus kafka start``
on a free port of ``free_ports`` with its own data dir), stops it for OUTAGE_S while a writer subprocess
runs, and starts it again with the same port and data dir.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.local_kafka.local_cluster import free_ports
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.topics import Topics
from tests.integration.test_shard_writer import (GROUP_SIZE, REPO, end_of_run, make_episode, manifests, publish,
                                                 read_topic)

pytestmark = pytest.mark.kafka

OUTAGE_S = 42.0
CLI = str(Path(sys.executable).parent / "rollout-bus")


def _broker(action: str, port: int, data_dir: Path) -> None:
    subprocess.run([CLI, "kafka", action, "--port", str(port), "--data-dir", str(data_dir)], check=True,
                   capture_output=True, timeout=120)


def _wait_for(condition, what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None:
            assert proc.poll() is None, f"the writer exited (rc={proc.returncode}) while waiting until {what}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def test_the_writer_survives_a_broker_outage_and_writes_what_comes_after_it(tmp_path):
    port, data_dir = free_ports(1)[0], tmp_path / "kafka"
    client_kwargs = {"bootstrap_servers": f"127.0.0.1:{port}"}
    topics = Topics(prefix="outage.")
    out, log_path = tmp_path / "shards", tmp_path / "writer.log"
    _broker("start", port, data_dir)
    proc = None
    try:
        ensure_topics(client_kwargs, topics)
        publish(client_kwargs, topics.episodes, [make_episode(g, r) for g in range(2) for r in range(GROUP_SIZE)])
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_bus.cli.shards", "--bootstrap-servers", client_kwargs["bootstrap_servers"],
                 "--topic-prefix", topics.prefix, "--out", str(out), "--dp-size", "2", "--groups-per-batch", "2",
                 "--group-id", "outage-writer", "--exit-on-end-of-run"], cwd=REPO, stdout=log, stderr=log)
        _wait_for(lambda: (out / "batch-00000000" / "manifest.json").exists(), "batch 0 is written", 60, proc)

        _broker("stop", port, data_dir)
        stopped = time.monotonic()
        _wait_for(lambda: time.monotonic() - stopped >= OUTAGE_S, f"{OUTAGE_S:.0f}s of outage passed",
                  OUTAGE_S + 5, proc)
        _broker("start", port, data_dir)

        publish(client_kwargs, topics.episodes,
                [make_episode(g, r) for g in (2, 3) for r in range(GROUP_SIZE)] + end_of_run(topics))
        assert proc.wait(timeout=90) == 0, log_path.read_text()[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        try:
            written = [(m["seq"], m["extra"]["partial"]) for m in manifests(out)]
            announced = sorted(json.loads(r.value)["seq"] for r in read_topic(client_kwargs, topics.shards)
                               if control_kind(r.headers) is None)
        finally:
            _broker("stop", port, data_dir)

    assert written == [(0, False), (1, False)]
    assert announced == [0, 1]
    log = log_path.read_text()
    waits = [line for line in log.splitlines() if "waiting for broker:" in line]
    assert waits, log[-3000:]  # it did wait, out loud ...
    assert "Traceback" not in log  # ... and never died
