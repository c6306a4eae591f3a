"""Operator mistakes are refused before anything is created or written: one line naming the problem, exit 2;
a cluster that does not answer is said in one line within seconds, without kafka-python's own ERROR lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout_bus.cli.main import app
from rollout_bus.consumers.shard_writer.writer_lock import LOCK_NAME, hold_writer_lock
from tests.unit.consumers.shard_writer.test_recovery import write_batches

CLOSED = "127.0.0.1:1"  # nothing listens there; no command below may get as far as asking it
COMMANDS = {"demo": [], "shards": [], "generate": [], "stream": [], "train": [], "train-sim": [],
            "end-run": ["--run-id", "r1"]}
runner = CliRunner()


def refused(args: list[str], cwd) -> str:
    """The one line a command refuses ``args`` with (exit 2), from ``cwd``, which it must leave as it was."""
    before = sorted(cwd.rglob("*"))
    os.chdir(cwd)
    done = runner.invoke(app, [*args, "--bootstrap-servers", CLOSED])
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert done.exit_code == 2 and len(lines) == 1, done.output
    assert sorted(cwd.rglob("*")) == before, "the refused command wrote something"
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_topic_prefix_kafka_would_refuse_is_one_line(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused([command, *COMMANDS[command], "--topic-prefix", "my run!"], tmp_path)
    assert line.startswith("error:") and "topic prefix" in line and "found ' !'" in line


@pytest.mark.parametrize("args", [["demo", "--out"], ["shards", "--out"], ["stream", "--data-dir"],
                                  ["train", "--checkpoint-dir"], ["train-sim", "--checkpoint-dir"]])
def test_a_directory_to_write_that_is_a_file_is_one_line(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file")
    line = refused([*args, "taken"], tmp_path)
    assert "taken: it is a file, not a directory" in line and f"({args[1]} must be a directory" in line
    assert "/sub: " in refused([*args, "taken/sub"], tmp_path)


def test_generate_summary_out_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file")
    assert "--summary-out" in refused(["generate", "--summary-out", "taken/summary.json"], tmp_path)
    assert "is a directory" in refused(["generate", "--summary-out", str(tmp_path)], tmp_path)


def another_runs_dir(root: Path) -> tuple[Path, bytes]:
    """``root/other``: what a demo run R1 left (run.json, a log, the shard writer's lock released), and its lock."""
    other = root / "other"
    (other / "logs").mkdir(parents=True)
    (other / "logs" / "shards.log").write_text("the other run's log\n")
    (other / "run.json").write_text(json.dumps({"run_id": "R1", "topic_prefix": "demo-R1."}))
    with hold_writer_lock(other / "shards", {"group": "demo-R1.rollout-bus-shards"}):
        lock = (other / "shards" / LOCK_NAME).read_bytes()
    return other, lock


def test_a_read_only_directory_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real = os.access
    here = os.path.realpath(tmp_path)
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.realpath(p) == here and mode & os.W_OK
                        else real(p, mode))  # as root, chmod does not make a directory read-only
    for args in (["demo", "--out", "o"], ["shards", "--out", "o"], ["train-sim", "--checkpoint-dir", "o"]):
        assert "read-only for this process" in refused(args, tmp_path)


def test_demo_refuses_an_out_holding_another_run_and_leaves_its_logs_and_lock_as_they_were(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other, lock = another_runs_dir(tmp_path)
    line = refused(["demo", "--out", "other"], tmp_path)
    assert "--out other holds run R1 (topics demo-R1.rollout.*): run.json, logs, shards" in line
    assert (other / "logs" / "shards.log").read_text() == "the other run's log\n"
    assert (other / "shards" / LOCK_NAME).read_bytes() == lock
    (other / "run.json").unlink()  # a demo directory from before run.json: its logs still say it is a run's
    assert "holds another run: logs, shards" in refused(["demo", "--out", "other"], tmp_path)


def test_shards_refuses_an_out_another_writer_holds_or_another_runs_batches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "held").mkdir()
    with hold_writer_lock(tmp_path / "held", {"group": "g1"}):
        line = refused(["shards", "--out", "held"], tmp_path)
    assert line.startswith("error: shard writer refused: another shard writer is writing to") and "group=g1" in line
    write_batches(tmp_path / "old", [0])  # read from rollout.episodes
    line = refused(["shards", "--out", "old", "--topic-prefix", "run7."], tmp_path)
    assert "holds batches of another run" in line and "run7.rollout.episodes" in line


def _closed_port() -> str:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _run(args: list[str], tmp_path, wait_s: float = 15.0) -> tuple[int | None, list[str], float]:
    """Run ``python -m rollout_bus.cli.main args`` until it exits or ``wait_s`` pass; its stderr lines."""
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rollout_bus.cli.main", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})
    try:
        out, _ = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, [line for line in out.splitlines() if line.strip()], time.monotonic() - began


@pytest.mark.parametrize("args", [["end-run", "--run-id", "r1"], ["demo", "--topic-prefix", "p."]])
def test_a_closed_port_ends_a_one_shot_command_in_one_line_within_seconds(args, tmp_path):
    bootstrap = _closed_port()
    code, lines, took = _run([*args, "--bootstrap-servers", bootstrap], tmp_path)
    assert code == 1 and took < 15.0, (code, lines, took)
    assert lines == [f"error: no Kafka cluster answered at '{bootstrap}': {bootstrap} refuses connections (nothing "
                     "listens there: is the broker up, is the port right?)"]
    assert list(tmp_path.iterdir()) == []


def test_a_stage_that_rides_out_outages_says_a_closed_port_in_one_line_at_once(tmp_path):
    bootstrap = _closed_port()
    code, lines, took = _run(["shards", "--out", "s", "--bootstrap-servers", bootstrap], tmp_path, wait_s=9.0)
    assert code is not None and code < 0, (code, lines)  # still waiting for the broker when stopped
    waits = [line for line in lines if "waiting for broker" in line]
    assert len(waits) == 1 and f"{bootstrap} refuses connections" in waits[0], lines
    assert not [line for line in lines if " kafka." in line or " aiokafka" in line], lines
    assert not (tmp_path / "s").exists()
