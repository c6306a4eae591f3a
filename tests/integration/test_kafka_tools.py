"""Kafka's own tools, from the project's jars (``rollout-bus kafka tool``), read what the pipeline wrote: the
console consumer prints the shard announcements, and consumer-groups describes the shard writer's group:
its committed offsets and lag, and no members (the writer assigns its partitions itself; README); configs and
metadata-quorum describe a topic's effective settings and the KRaft controller."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_shard_writer import GROUP_SIZE, publish, run_writer, standard_records

pytestmark = pytest.mark.kafka


def _tool(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", "kafka", "tool", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_console_consumer_and_consumer_groups_read_a_run(kafka_bootstrap, client_kwargs, topics, tmp_path):
    records = standard_records(topics)
    publish(client_kwargs, topics.episodes, records)
    run_writer(kafka_bootstrap, topics, tmp_path / "out", "tools-writer")

    shards = _tool("console-consumer", "--bootstrap-server", kafka_bootstrap, "--topic", topics.shards,
                   "--from-beginning", "--max-messages", "1", "--property", "print.key=true",
                   "--property", "key.separator=|")
    key, value = shards.stdout.strip().splitlines()[0].split("|", 1)
    announced = json.loads(value)
    assert key == "0" and announced["seq"] == 0 and announced["dir"] == "batch-00000000"
    assert announced["out_root"] == str((tmp_path / "out").resolve())

    group = topics.group("tools-writer")
    described = _tool("consumer-groups", "--bootstrap-server", kafka_bootstrap, "--describe", "--group", group)
    said = described.stdout + described.stderr
    assert "has no active members" in said  # honest: the writer is not a group member (it assigns itself)
    rows = [line.split() for line in described.stdout.splitlines() if line.startswith(group)]
    assert {row[1] for row in rows} == {topics.episodes} and len(rows) == topics.episodes_partitions
    committed = sum(int(row[3]) for row in rows if row[3] != "-")
    assert committed == sum(int(row[4]) for row in rows) and committed >= 7 * GROUP_SIZE  # caught up: lag 0


def test_configs_and_metadata_quorum_describe_the_topics_and_the_controller(kafka_bootstrap, topics):
    configs = _tool("configs", "--bootstrap-server", kafka_bootstrap, "--describe", "--all",
                    "--entity-type", "topics", "--entity-name", topics.turns)
    assert f"All configs for topic {topics.turns} are:" in configs.stdout
    assert "  min.insync.replicas=1 " in configs.stdout  # the test broker's default (a cluster shows 2)
    quorum = _tool("metadata-quorum", "--bootstrap-server", kafka_bootstrap, "describe", "--status")
    assert "LeaderId:" in quorum.stdout and "CurrentVoters:" in quorum.stdout
