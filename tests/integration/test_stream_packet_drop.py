"""A network partition that drops packets (not refuses them) is said by the stream worker, as the other stages
say theirs: ``waiting for broker ...`` while the broker's port drops every packet, ``broker answers again``
once it does not. Made with iptables DROP on the broker's port (root); skipped, saying why, without it."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pytest

from tests.integration.test_stream_worker import Worker, _wait_for_stable_group

pytestmark = pytest.mark.kafka


def _rules(port: int) -> list[list[str]]:
    return [["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
            ["INPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"]]


@pytest.fixture
def drop_port():
    iptables = shutil.which("iptables")
    if iptables is None:
        pytest.skip("iptables is not installed")
    if subprocess.run([iptables, "-L", "INPUT", "-n"], capture_output=True).returncode != 0:
        pytest.skip("iptables cannot be used here (needs root and netfilter)")
    added: list[list[str]] = []

    def drop(port: int) -> None:
        for rule in _rules(port):
            subprocess.run([iptables, "-I", *rule], check=True)
            added.append(rule)

    def lift() -> None:
        while added:
            subprocess.run([iptables, "-D", *added.pop()], check=False)

    drop.lift = lift
    try:
        yield drop
    finally:
        lift()  # never leave the broker's port dropped for the tests after this one


def _wait_for(worker: Worker, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in worker.log():
        assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:.0f}s:\n{worker.log()[-3000:]}"
        time.sleep(0.5)


def test_the_stream_worker_says_when_the_broker_drops_its_packets_and_when_it_answers_again(
        kafka_bootstrap, topics, tmp_path, drop_port):
    port = int(kafka_bootstrap.rsplit(":", 1)[1])
    app_id = f"drop-{uuid.uuid4().hex[:8]}"
    worker = Worker(kafka_bootstrap, topics, app_id, tmp_path)
    try:
        _wait_for_stable_group(kafka_bootstrap, topics.group(app_id), members=1)  # running: holds its partitions
        drop_port(port)
        _wait_for(worker, "waiting for broker: no answer from", 60)
        drop_port.lift()
        _wait_for(worker, "broker answers again after", 120)
    finally:
        drop_port.lift()
        code = worker.stop()
    log = worker.log()
    line = next(line for line in log.splitlines() if "waiting for broker: no answer from" in line)
    assert f"bootstrap_servers={kafka_bootstrap}" in line and "does not answer a TCP connect" in line, line
    assert code == 0 and "Traceback" not in log and "is overlapping" not in log, log[-3000:]
