"""A full disk under the shard writer is waited out, as a broker outage is: on a real, tiny tmpfs.

The writer's ``--out`` is a 2 MiB tmpfs that a filler file fills up before the first batch is due.
The writer must not die (it did: ``OSError: [Errno 28]`` and a 100-line traceback, then a crash loop),
must say on one line what it waits for (the batch, the path, the bytes needed), and must announce or
commit nothing of that batch; once the filler is removed it writes the batch, announces it and ends
the run normally. Needs root (mount); skipped, saying why, without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.wire.headers import control_kind
from rollout_bus.wire.topics import Topics
from tests.integration.test_shard_writer import (GROUP_SIZE, REPO, end_of_run, make_episode, manifests, publish,
                                                 read_topic)

pytestmark = pytest.mark.kafka


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path) -> Path:
    filler = mount / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


def test_the_writer_waits_for_disk_space_and_writes_the_batch_when_it_frees(kafka_bootstrap, tiny_disk, tmp_path):
    client_kwargs = {"bootstrap_servers": kafka_bootstrap}
    topics = Topics(prefix=f"diskfull{int(time.time() * 1000) % 10**8}.")
    out, log_path = tiny_disk / "shards", tmp_path / "writer.log"
    ensure_topics(client_kwargs, topics)
    out.mkdir()
    filler = _fill(tiny_disk)
    publish(client_kwargs, topics.episodes,
            [make_episode(g, r) for g in range(2) for r in range(GROUP_SIZE)] + end_of_run(topics))
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_bus.cli.shards", "--bootstrap-servers", kafka_bootstrap,
             "--topic-prefix", topics.prefix, "--out", str(out), "--dp-size", "2", "--groups-per-batch", "2",
             "--group-id", "disk-full-writer", "--exit-on-end-of-run"], cwd=REPO, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while "waiting for disk space" not in log_path.read_text():
            assert proc.poll() is None, f"the writer exited (rc={proc.returncode}):\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2.0)  # it keeps waiting, and announces nothing meanwhile
        assert proc.poll() is None
        assert [r for r in read_topic(client_kwargs, topics.shards) if control_kind(r.headers) is None] == []
        filler.unlink()
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = log_path.read_text()
    line = next(line for line in log.splitlines() if "waiting for disk space" in line)
    assert "batch 0" in line and str(out) in line and "bytes" in line and "free" in line, line
    assert "Traceback" not in log and "disk space back" in log
    assert [m["seq"] for m in manifests(out)] == [0]
    announced = [json.loads(r.value)["seq"] for r in read_topic(client_kwargs, topics.shards)
                 if control_kind(r.headers) is None]
    assert announced == [0]
