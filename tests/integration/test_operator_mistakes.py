"""On the real broker: a refused ``demo`` or ``shards`` creates no topic and writes no record (the mistakes are
checked before the cluster is touched), and a demo's --out holding another run is left as it was."""

from __future__ import annotations

import os
import uuid

from kafka import KafkaAdminClient
from typer.testing import CliRunner

from rollout_bus.cli.main import app
from rollout_bus.consumers.shard_writer.writer_lock import LOCK_NAME, hold_writer_lock
from tests.unit.cli.test_operator_mistakes import another_runs_dir

runner = CliRunner()


def _topics_under(client_kwargs, prefix: str) -> list[str]:
    admin = KafkaAdminClient(**client_kwargs)
    try:
        return sorted(t for t in admin.list_topics() if t.startswith(prefix))
    finally:
        admin.close()


def _refused(args: list[str]) -> str:
    done = runner.invoke(app, args)
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert done.exit_code == 2 and len(lines) == 1, done.output
    return lines[0]


def test_refused_demo_and_shards_create_no_topic_and_leave_the_other_run_as_it_was(kafka_bootstrap, client_kwargs,
                                                                                   tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}."
    on = ["--bootstrap-servers", kafka_bootstrap, "--topic-prefix", prefix]
    (tmp_path / "a-file").write_text("x")
    other, lock = another_runs_dir(tmp_path)
    assert "it is a file" in _refused(["demo", *on, "--out", str(tmp_path / "a-file")])
    assert "holds run R1" in _refused(["demo", *on, "--out", str(other)])
    assert "it is a file" in _refused(["shards", *on, "--out", str(tmp_path / "a-file")])
    with hold_writer_lock(tmp_path / "held", {"group": "g"}):  # shards used to write rollout.run first
        assert "another shard writer" in _refused(["shards", *on, "--out", str(tmp_path / "held")])
    assert _topics_under(client_kwargs, prefix) == []
    assert (other / "logs" / "shards.log").read_text() == "the other run's log\n"
    assert (other / "shards" / LOCK_NAME).read_bytes() == lock
    assert sorted(os.listdir(other)) == ["logs", "run.json", "shards"]
