"""The compose topology, run as local processes against the real test broker.

The services' own commands and environment are read from compose/docker-compose.yml (its
``${NAME:-default}`` interpolation fed a few small values, as a user's ``.env`` would), with only
what a container gives for free replaced: the bootstrap servers become the test broker's, the
topic prefix is made unique to this run (which scopes the consumer groups too), and container paths are
mapped under a temporary directory (a named volume to one folder shared by its users). Then
``topics`` runs once, two ``stream`` replicas (``--scale stream=2``) and ``shards`` start, the
``generator`` runs to completion, and every episode it sent must end up in a verified shard or on
the DLQ. Skipped, with the reason, while a stage command does not exist yet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from functools import cache
from pathlib import Path

import pytest

from tests.integration.groups import stable_group
from rollout_bus.model.shards import read_manifest, verify_batch
from tests.unit.compose.test_compose import BASE, command_path, environment, load

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
PIPELINE = ("topics", "generator", "stream", "shards")
STREAM_REPLICAS = 2
EPISODES = 24
COMPOSE_ENV = {  # what a user would put in compose/.env for a small run
    "ROLLOUT_BUS_EPISODES": str(EPISODES),
    "ROLLOUT_BUS_TURNS_PARTITIONS": "6",
}


@cache
def launcher(path: tuple[str, ...]) -> tuple[str, ...] | None:
    """How to run ``rollout-bus <path>`` here: the entry point's module, else the stage's own module."""
    for argv in ((sys.executable, "-m", "rollout_bus.cli.main", *path),
                 (sys.executable, "-m", f"rollout_bus.cli.{path[0]}", *path[1:])):
        done = subprocess.run([*argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode == 0:
            return argv[: len(argv) - len(path)] if argv[2] == "rollout_bus.cli.main" else argv[:3]
    return None


def argv_of(command: list[str]) -> list[str]:
    path = tuple(command_path(command))
    prefix = launcher(path)
    if prefix is None:
        pytest.skip(f"`rollout-bus {' '.join(path)}` does not exist yet (its --help fails)")
    args = command[1:] if prefix[-1] == "rollout_bus.cli.main" else command[2:]
    return [*prefix, *args]


def local_env(service: dict, *, bootstrap: str, unique: str, root: Path, replica: str) -> dict[str, str]:
    """The service's environment as this machine needs it (see the module docstring)."""
    volumes = {str(v).split(":")[1]: root / "volumes" / str(v).split(":")[0] for v in service.get("volumes", [])}
    env = environment(service)
    for name, value in env.items():
        if value.startswith("/"):
            mount = next((t for t in volumes if value == t or value.startswith(t + "/")), None)
            local = (volumes[mount] / value[len(mount):].lstrip("/") if mount
                     else root / "containers" / replica / value.lstrip("/"))
            local.parent.mkdir(parents=True, exist_ok=True)  # the image (or the mounted volume) has the parents
            env[name] = str(local)
    env["ROLLOUT_BUS_BOOTSTRAP_SERVERS"] = bootstrap
    env["ROLLOUT_BUS_TOPIC_PREFIX"] = f"{unique}.{env.get('ROLLOUT_BUS_TOPIC_PREFIX', '')}"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_BUS_")}
    return {**inherited, **env}


class Processes:
    """The started services; logs under ``root/logs``, stopped with SIGTERM then SIGKILL."""

    def __init__(self, root: Path) -> None:
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.running[name] = proc
        return proc

    def exited(self, *one_shots: str) -> list[str]:
        """Long-running services that have stopped (one-shot ones are expected to)."""
        return [n for n, p in self.running.items() if n not in one_shots and p.poll() is not None]

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.iterdir()))

    def stop(self) -> None:
        for proc in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def dead_letter_keys(client_kwargs: dict, topic: str) -> list[bytes]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, **client_kwargs, auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=3000)
    try:
        return [record.key for record in consumer]
    finally:
        consumer.close()


def shard_episode_keys(out: Path) -> list[str]:
    keys = []
    for batch in sorted(out.glob("batch-*")):
        if read_manifest(batch) is not None:
            keys.extend(e["key"] for e in verify_batch(batch)["extra"]["episodes"])
    return keys


def assignments(client_kwargs: dict, group: str, topic: str) -> list[list[int]]:
    """Per member of a stable consumer group, its partitions of ``topic`` (empty while rebalancing)."""
    info = stable_group(client_kwargs, group)
    if info is None:
        return []
    return [sorted(p for a in (m.get("member_assignment") or {}).get("assigned_partitions", []) if a["topic"] == topic
                   for p in a["partitions"]) for m in info.get("members") or []]


def wait_for_replicas(client_kwargs: dict, group: str, topic: str, procs: "Processes", timeout_s: float = 120) -> list:
    """Until every stream replica is a member of the one group and holds partitions of rollout.turns."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        seen = assignments(client_kwargs, group, topic)
        if len(seen) == STREAM_REPLICAS and all(seen):
            return seen
        assert not procs.exited("topics"), procs.tails()
        time.sleep(1)
    raise AssertionError(f"stream replicas never shared group {group}: {seen}\n{procs.tails()}")


def turns_partitions(client_kwargs: dict, topic: str) -> int:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(**client_kwargs)
    try:
        return len(consumer.partitions_for_topic(topic) or ())
    finally:
        consumer.close()


def test_the_compose_services_run_as_local_processes_turn_every_episode_into_shards(kafka_bootstrap, tmp_path):
    services = load(BASE, env=COMPOSE_ENV)["services"]
    commands = {name: argv_of(services[name]["command"]) for name in PIPELINE}
    unique = f"cp{uuid.uuid4().hex[:8]}"
    envs = {name: local_env(services[name], bootstrap=kafka_bootstrap, unique=unique, root=tmp_path, replica=name)
            for name in PIPELINE}
    out = Path(envs["shards"]["ROLLOUT_BUS_OUT"])
    prefix = envs["topics"]["ROLLOUT_BUS_TOPIC_PREFIX"]
    client_kwargs = {"bootstrap_servers": kafka_bootstrap}
    procs = Processes(tmp_path)
    try:
        assert procs.start("topics", commands["topics"], envs["topics"]).wait(timeout=120) == 0, procs.tails()
        assert turns_partitions(client_kwargs, f"{prefix}rollout.turns") == 6, "topics ignored its variables"
        for i in range(1, STREAM_REPLICAS + 1):
            replica = local_env(services["stream"], bootstrap=kafka_bootstrap, unique=unique, root=tmp_path,
                                replica=f"stream-{i}")
            procs.start(f"stream-{i}", commands["stream"], replica)
        procs.start("shards", commands["shards"], envs["shards"])
        shared = wait_for_replicas(client_kwargs, f"{prefix}{envs['stream']['ROLLOUT_BUS_APP_ID']}",
                                   f"{prefix}rollout.turns", procs)
        assert sorted(p for member in shared for p in member) == list(range(6)), shared
        assert procs.start("generator", commands["generator"], envs["generator"]).wait(timeout=240) == 0, \
            procs.tails()
        deadline, keys, dead = time.monotonic() + 180, [], []
        while time.monotonic() < deadline:
            assert not procs.exited("topics", "generator"), f"exited early\n{procs.tails()}"
            keys, dead = shard_episode_keys(out), dead_letter_keys(client_kwargs, f"{prefix}rollout.dlq")
            if len(set(keys)) + len(set(dead)) >= EPISODES:
                break
            time.sleep(2)
    finally:
        procs.stop()
    assert len(keys) == len(set(keys)), "an episode was written twice"
    assert len(set(keys)) + len(set(dead)) == EPISODES, f"{len(set(keys))} in shards, {len(dead)} dead\n{procs.tails()}"
    assert keys, "no shard was written"
    assert out.is_relative_to(tmp_path / "volumes" / "shards"), "the shards volume was not where compose mounts it"
