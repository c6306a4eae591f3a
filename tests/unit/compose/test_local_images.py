"""The local stand-ins for the public images (compose/images/, built by compose/compose-test.sh) keep the
contract the compose files rely on, checked without a docker engine.

The Kafka image's entry point reads the apache/kafka image's variables: run here with a ``java`` that only
records its arguments, it must turn each broker's KAFKA_* environment from both layouts into the server
properties Kafka spells, format the storage with CLUSTER_ID, then start ``kafka.Kafka`` on that file. And
every image in the compose files is a variable whose default is the public image, so the same files run on
either.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.compose.test_compose import BASE, CLUSTER, COMPOSE, environment, load

RUN = COMPOSE / "images" / "kafka" / "run"


def run_entry_point(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict, list]:
    """The entry point with ``env`` and a recording ``java``: (its result, the properties, java's argv lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "java-calls"
    (bin_dir / "java").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {calls}\n')
    (bin_dir / "java").chmod(0o755)
    props = tmp_path / "server.properties"
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SERVER_PROPERTIES": str(props), **env}
    done = subprocess.run(["bash", str(RUN)], env=full, capture_output=True, text=True, timeout=60, check=False)
    written = dict(line.split("=", 1) for line in props.read_text().splitlines()) if props.exists() else {}
    return done, written, calls.read_text().splitlines() if calls.exists() else []


def test_the_single_broker_environment_becomes_kafkas_own_properties(tmp_path):
    env = environment(load(BASE)["services"]["kafka"])
    done, props, calls = run_entry_point(env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert props == {
        "node.id": "1",
        "process.roles": "broker,controller",
        "controller.quorum.voters": "1@kafka:9093",
        "listeners": "INTERNAL://:9092,CONTROLLER://:9093,EXTERNAL://:29092",
        "advertised.listeners": "INTERNAL://kafka:9092,EXTERNAL://localhost:29092",
        "listener.security.protocol.map": "INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT,EXTERNAL:PLAINTEXT",
        "inter.broker.listener.name": "INTERNAL",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": "/var/lib/kafka/data",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "log.retention.hours": "24",
    }
    assert len(calls) == 2, calls
    assert "kafka.tools.StorageTool format" in calls[0] and f"--cluster-id={env['CLUSTER_ID']}" in calls[0]
    assert "--ignore-formatted" in calls[0]  # a restarted broker keeps its formatted log dirs
    assert calls[1].endswith(f"kafka.Kafka {tmp_path / 'server.properties'}")


@pytest.mark.parametrize("node", ["kafka", "kafka-2", "kafka-3"])
def test_each_cluster_node_gets_its_id_listeners_and_the_shared_voters(node, tmp_path):
    env = environment(load(BASE, CLUSTER)["services"][node])
    done, props, _ = run_entry_point(env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert props["node.id"] == env["KAFKA_NODE_ID"]
    assert props["controller.quorum.voters"] == "1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"
    assert props["advertised.listeners"].startswith(f"INTERNAL://{node}:9092,")
    assert props["min.insync.replicas"] == "2" and props["default.replication.factor"] == "3"


def test_underscores_follow_the_official_images_rule_and_jvm_options_are_not_properties(tmp_path):
    env = {"CLUSTER_ID": "c1", "KAFKA_NODE_ID": "7", "KAFKA_LISTENER_NAME_INTERNAL_SSL___CLIENT__AUTH": "none",
           "KAFKA_HEAP_OPTS": "-Xmx2G", "KAFKA_OPTS": "-Dx=y", "KAFKA_LOG_LEVEL": "DEBUG"}
    done, props, calls = run_entry_point(env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert props == {"listener.name.internal.ssl-client_auth": "none", "node.id": "7"}
    assert calls[1].startswith("-Xmx2G ") and " -Dx=y " in calls[1]


def test_a_mounted_properties_file_is_the_base_a_variable_wins_and_no_secret_is_printed(tmp_path):
    secret = "s3cret-keystore-pass"
    file_input = tmp_path / "file-input.properties"
    file_input.write_text(f"# the secured stack's secrets\nssl.keystore.password={secret}\nnode.id=9\n\n"
                          f"listener.name.internal.scram-sha-512.sasl.jaas.config=x required password=\"{secret}\";\n")
    env = {"CLUSTER_ID": "c1", "KAFKA_NODE_ID": "1", "KAFKA_FILE_INPUT": str(file_input)}
    done, props, calls = run_entry_point(env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert props["ssl.keystore.password"] == secret and props["node.id"] == "1"  # the variable wins, as in Kafka
    assert "ssl.keystore.password=[hidden]" in done.stderr and secret not in done.stderr + "".join(calls)


@pytest.mark.parametrize("missing", ["CLUSTER_ID", "KAFKA_NODE_ID"])
def test_a_missing_cluster_id_or_node_id_is_named_and_nothing_starts(missing, tmp_path):
    env = {"CLUSTER_ID": "c1", "KAFKA_NODE_ID": "1"}
    del env[missing]
    done, _, calls = run_entry_point(env, tmp_path)
    assert done.returncode != 0 and missing in done.stderr and calls == []


@pytest.mark.parametrize("path", [BASE, CLUSTER], ids=lambda p: p.name)
def test_every_image_is_a_variable_defaulting_to_the_public_image(path):
    raw = yaml.safe_load(path.read_text())
    anchors = [v for k, v in raw.items() if k.startswith("x-") and isinstance(v, dict) and "image" in v]
    images = [s["image"] for s in [*raw["services"].values(), *anchors] if "image" in s]
    assert images
    for image in images:
        found = re.fullmatch(r"\$\{(ROLLOUT_BUS_[A-Z_]+_IMAGE|ROLLOUT_BUS_IMAGE):-([^}]+)\}", image)
        assert found, f"{path.name}: image {image!r} is not ${{ROLLOUT_BUS_..._IMAGE:-public default}}"
    build = raw["x-rollout-bus"]["build"] if "x-rollout-bus" in raw else None
    if build is not None:
        assert build["args"]["PYTHON_IMAGE"] == "${ROLLOUT_BUS_PYTHON_IMAGE:-python:3.11.11-slim-bookworm}"


def test_the_dockerfile_needs_no_registry_beyond_its_base_image():
    text = (COMPOSE / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M)  # a syntax line pulls the frontend from Docker Hub
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${PYTHON_IMAGE}"]
    rules = [line for line in (COMPOSE.parent / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "**" and "!.venv" not in rules, "the build context starts from nothing but the sources"
