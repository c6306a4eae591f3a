"""The run's batching, declared once on rollout.run: the first declaration wins, a stage that differs is refused
by name before it reads or writes anything else, against the real broker (CLI processes included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_bus.errors import ConfigError
from rollout_bus.kafka.clients import new_producer
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.kafka.run_record import check_run_batching
from rollout_bus.wire.run_record import RUN_BATCHING_KEY, RunBatching

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "COLUMNS": "300"}  # rich wraps at the terminal width: one message, one line


def on_topic(client_kwargs, topic: str) -> list:
    reader = TopicReader(client_kwargs, [topic])
    try:
        return reader.read_to_end(30)[topic]
    finally:
        reader.close()


def test_the_first_declaration_is_the_run_s_and_an_equal_one_is_accepted(client_kwargs, topics):
    writer = RunBatching(4, "step", 1, "shard writer@a:1")
    assert check_run_batching(client_kwargs, topics, writer) == writer
    generator = RunBatching(4, "step", 1, "generator@b:2")
    assert check_run_batching(client_kwargs, topics, generator) == writer  # the run's, declared by the writer
    records = on_topic(client_kwargs, topics.run)
    assert [(r.key, RunBatching.parse(r.value)) for r in records] == [(RUN_BATCHING_KEY, writer)]


def test_a_stage_whose_batching_differs_is_refused_naming_each_setting_and_who_declared(client_kwargs, topics):
    check_run_batching(client_kwargs, topics, RunBatching(2, "step", None, "shard writer@a:1"))
    with pytest.raises(ConfigError) as refused:
        check_run_batching(client_kwargs, topics, RunBatching(4, "step", 1, "generator@b:2"))
    message = str(refused.value)
    for part in ("generator@b:2", "shard writer@a:1", f"{topics.run}:0:0", "groups_per_batch=2 vs 4",
                 "max_staleness=None vs 1"):
        assert part in message, message
    assert "batching=" not in message.split("vs")[0].split(":")[-1]  # the setting that agrees is not named
    assert len(on_topic(client_kwargs, topics.run)) == 1  # a refused stage declares nothing


def test_when_two_declarations_raced_the_first_in_the_log_wins(client_kwargs, topics):
    producer = new_producer(client_kwargs, acks="all")
    for declared in (RunBatching(3, "step", None, "first"), RunBatching(5, "step", None, "second")):
        producer.send(topics.run, key=RUN_BATCHING_KEY, value=declared.value(), partition=0).get(timeout=30)
    producer.close()
    assert check_run_batching(client_kwargs, topics, RunBatching(3, "step", None, "third")).declared_by == "first"
    with pytest.raises(ConfigError, match="groups_per_batch=3 vs 5"):
        check_run_batching(client_kwargs, topics, RunBatching(5, "step", None, "fourth"))


def test_a_declaration_that_does_not_parse_is_named_by_position(client_kwargs, topics):
    producer = new_producer(client_kwargs, acks="all")
    producer.send(topics.run, key=RUN_BATCHING_KEY, value=b"{}", partition=0).get(timeout=30)
    producer.close()
    with pytest.raises(ConfigError, match=f"{topics.run}:0:0 does not parse"):
        check_run_batching(client_kwargs, topics, RunBatching(4, "step", None, "x"))


def test_the_commands_refuse_a_run_whose_batching_differs_and_send_nothing(kafka_bootstrap, client_kwargs, topics,
                                                                           tmp_path):
    check_run_batching(client_kwargs, topics, RunBatching(2, "step", 1, "shard writer@elsewhere:7"))
    common = ["--bootstrap-servers", kafka_bootstrap, "--topic-prefix", topics.prefix]
    generate = subprocess.run([sys.executable, "-m", "rollout_bus.cli.generate", *common, "--episodes", "8",
                               "--max-staleness", "1", "--groups-per-batch", "4"],
                              cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    assert generate.returncode == 2, generate.stdout + generate.stderr
    assert "generator refused" in generate.stderr and "groups_per_batch=2 vs 4" in generate.stderr, generate.stderr
    assert on_topic(client_kwargs, topics.turns) == []
    shards = subprocess.run([sys.executable, "-m", "rollout_bus.cli.shards", *common, "--out", str(tmp_path / "out"),
                             "--groups-per-batch", "2", "--exit-when-idle"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    assert shards.returncode == 2, shards.stdout + shards.stderr
    assert "shard writer refused" in shards.stderr and "max_staleness=1 vs None" in shards.stderr, shards.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("batch-*"))
