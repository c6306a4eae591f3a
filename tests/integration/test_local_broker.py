"""The managed broker's lifecycle, on a port and data directory of its own (the suite's broker is untouched)."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time

import pytest

from rollout_bus.errors import BrokerError
from rollout_bus.local_kafka import runtime
from rollout_bus.local_kafka.local_broker import (LOG4J2, LocalBroker, format_storage, new_cluster_id, port_is_free,
                                            server_properties)

PORT = 39192


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", "kafka", *args], capture_output=True,
                          text=True, timeout=180)


def test_start_twice_is_harmless_status_sees_a_kill_and_stop_leaves_nothing(tmp_path):
    data = tmp_path / "broker"
    first = _cli("start", "--port", str(PORT), "--data-dir", str(data))
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"127.0.0.1:{PORT}"
    pid = int((data / "broker.pid").read_text())

    second = _cli("start", "--port", str(PORT), "--data-dir", str(data))
    assert second.returncode == 0 and "already up" in second.stderr
    assert int((data / "broker.pid").read_text()) == pid
    assert _cli("status", "--port", str(PORT), "--data-dir", str(data)).stdout.startswith("up ")

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    down = _cli("status", "--port", str(PORT), "--data-dir", str(data))
    assert down.returncode == 3 and down.stdout.startswith("down ")

    restarted = _cli("start", "--port", str(PORT), "--data-dir", str(data))
    assert restarted.returncode == 0, restarted.stderr
    new_pid = int((data / "broker.pid").read_text())
    stopped = _cli("stop", "--port", str(PORT), "--data-dir", str(data))
    assert stopped.returncode == 0 and "stopped" in stopped.stderr
    assert not os.path.exists(f"/proc/{new_pid}") or "Z" in open(f"/proc/{new_pid}/stat").read().split()[2]
    assert port_is_free(PORT) and port_is_free(PORT + 1)
    assert _cli("status", "--port", str(PORT), "--data-dir", str(data)).returncode == 3


def test_start_refuses_a_taken_port_and_says_what_to_do(tmp_path):
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", PORT + 10))
        squatter.listen()
        with pytest.raises(BrokerError, match=f"port {PORT + 10} .* is taken .*--port"):
            LocalBroker(port=PORT + 10, data_dir=tmp_path / "b").start()


def test_missing_java_is_reported_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerError, match="Java 17 or newer is needed"):
        LocalBroker(port=PORT + 20, data_dir=tmp_path / "b").start()


def test_a_broker_that_dies_while_starting_is_reported_with_its_log(tmp_path, monkeypatch):
    from rollout_bus.local_kafka import local_broker

    monkeypatch.setattr(local_broker.LocalBroker, "heap", "-Xmx1k")  # the JVM refuses to start with this heap
    with pytest.raises(BrokerError, match="exited with code") as caught:
        LocalBroker(port=PORT + 30, data_dir=tmp_path / "b").start(timeout_s=60)
    assert "heap" in str(caught.value).lower()


def test_a_port_without_room_for_the_controller_is_refused_by_name():
    with pytest.raises(ValueError, match="'port' must be in 1..65534"):
        LocalBroker(port=65535)
    done = _cli("start", "--port", "99999")
    assert done.returncode != 0 and "--port" in done.stderr and "Traceback" not in done.stderr


def test_a_cluster_id_never_starts_with_a_dash_which_the_storage_tool_reads_as_an_option():
    dash_first = bytes([0xF8]) + bytes(15)  # base64url "-A..."
    draws = iter([dash_first, dash_first, bytes(16)])
    assert base64.urlsafe_b64encode(dash_first).decode().startswith("-")
    assert new_cluster_id(lambda: next(draws)) == "AAAAAAAAAAAAAAAAAAAAAA"
    assert all(not new_cluster_id().startswith("-") for _ in range(2000))


def test_storage_formats_with_a_cluster_id_that_starts_with_a_dash(tmp_path):
    cluster_id = "-" + "A" * 21  # a valid id (base64url of 0xF8 and 15 zero bytes); `-t -AAA...` fails
    (tmp_path / "log4j2.properties").write_text(LOG4J2)
    properties = tmp_path / "server.properties"
    properties.write_text(server_properties(PORT + 40, PORT + 41, tmp_path))
    format_storage(runtime.java_executable(), runtime.ensure_jars(echo=lambda _: None), properties, cluster_id)
    meta = (tmp_path / "data" / "meta.properties").read_text().splitlines()
    assert f"cluster.id={cluster_id}" in meta
