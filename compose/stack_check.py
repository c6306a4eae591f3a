"""The compose stack brought up for real and checked from outside its containers (compose/compose-test.sh).

Two runs, each its own compose project, brought down with its volumes at the end (also on failure):

``single``: compose/docker-compose.yml with ``--scale stream=3``. The three stream containers must share
rollout.turns' partitions as one consumer group (shown with Kafka's own consumer-groups tool); the generator
runs to completion; then, read from the host through the published ports and the shards volume:

* every episode the generator put on rollout.turns is in exactly one verified batch (``verify_batch``),
  and nothing is on rollout.dlq;
* the exporter answers on 127.0.0.1:9464 with ``rollout_batches_total`` equal to the batches written;
* ``rollout-bus tail --once --json`` against the containerised broker sees the same batches;
* the ``observability`` profile's Prometheus (the local image: Debian's package), asked through its HTTP API on
  127.0.0.1:9090, has both targets up, the alert rules loaded and none firing, and ``rollout_batches_total``
  equal to the batches on the volume.

``cluster``: the base file plus compose/docker-compose.cluster.yml (three brokers). While the generator
is still sending, the ``kafka-2`` container is killed (SIGKILL); writes must go on with two brokers, the
container is started again, and the run must end with the same accounting as above. Kafka's own tools then
show every pipeline topic with replication factor 3 and ``min.insync.replicas=2``, and no under-replicated
partition once the broker has caught up.

``secure``: the base file plus compose/docker-compose.secure.yml (TLS, SCRAM principals per role, ACLs), its
secrets made beforehand in ``$ROLLOUT_BUS_SECRETS_DIR`` (``rollout-bus kafka secrets``). The run must end with
the same accounting, read from the host as the observer principal; a PLAINTEXT client is refused with its
reason and the generator principal may not publish weights; and no principal's password is in the resolved
compose model, any container's ``docker inspect`` (environment, command), the stack's logs or the exporter's
metrics.

Completion is never a guess from the clock: a run is over when the shard writer puts its end-of-run record
on rollout.shards (after its last batch). Timeouts only bound how long a broken run is waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from rollout_bus.errors import AccessDenied, BrokerError, RolloutBusError
from rollout_bus.consumers.feed.weights import WeightPublisher
from rollout_bus.kafka.clients import group_less_consumer, new_admin
from rollout_bus.local_kafka.compose_secrets import ComposeSecrets
from rollout_bus.kafka.reader import TopicReader, partition_offsets
from rollout_bus.wire.headers import control_kind
from rollout_bus.model.shards import read_manifest, verify_batch
from rollout_bus.wire.topics import Topics

COMPOSE_DIR = Path(__file__).resolve().parent
BASE = COMPOSE_DIR / "docker-compose.yml"
CLUSTER = COMPOSE_DIR / "docker-compose.cluster.yml"
SECURE = COMPOSE_DIR / "docker-compose.secure.yml"
SINGLE_BOOTSTRAP = "localhost:29092"
CLUSTER_BOOTSTRAP = "localhost:29092,localhost:29192,localhost:29292"
SINGLE_CONN, CLUSTER_CONN = {"bootstrap_servers": SINGLE_BOOTSTRAP}, {"bootstrap_servers": CLUSTER_BOOTSTRAP}
PIPELINE_TOPICS = ("rollout.turns", "rollout.episodes", "rollout.metrics", "rollout.shards", "rollout.dlq")
STREAM_GROUP = "rollout-bus-stream"  # ROLLOUT_BUS_APP_ID in the compose file
EXPORTER = "http://127.0.0.1:9464/metrics"
PROMETHEUS = "http://127.0.0.1:9090"
SINGLE_PROJECT, CLUSTER_PROJECT = "rollout-bus-ctest-single", "rollout-bus-ctest-cluster"  # compose project names
SECURE_PROJECT = "rollout-bus-ctest-secure"


class CheckFailed(Exception):
    """A check of the running stack did not hold; the message says which and what was seen."""


def say(message: str) -> None:
    print(f"[stack-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def rollout_bus(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> str:
    """``rollout-bus ARGS`` from the host's install (the same CLI an operator runs), its stdout; ``env``: more
    variables (a principal's settings)."""
    done = subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise CheckFailed(f"`rollout-bus {' '.join(args)}` exited {done.returncode}:\n{done.stderr[-2000:]}")
    return done.stdout


class Stack:
    """One compose project: its command line, its containers' states, its shards volume, its teardown."""

    def __init__(self, compose: list[str], project: str, files: list[Path]) -> None:
        self.project = project
        self.argv = [*compose, "-p", project, *(a for f in files for a in ("-f", str(f)))]

    def compose(self, *args: str, capture: bool = False, timeout: float = 900) -> str:
        done = subprocess.run([*self.argv, *args], text=True, timeout=timeout, check=False,
                              capture_output=capture)
        if done.returncode != 0:
            raise CheckFailed(f"`docker compose {' '.join(args)}` exited {done.returncode}"
                              + (f":\n{done.stderr[-2000:]}" if capture else ""))
        return done.stdout if capture else ""

    def containers(self, service: str) -> list[dict]:
        """``docker compose ps --all`` of one service: its containers' State and ExitCode."""
        out = self.compose("ps", "--all", "--format", "json", service, capture=True)
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if not rows and out.strip().startswith("["):
            rows = json.loads(out)
        return rows

    def state(self, service: str) -> tuple[str, int | None]:
        rows = self.containers(service)
        if not rows:
            return "absent", None
        return rows[0].get("State", "?"), rows[0].get("ExitCode")

    def copy_shards(self, dest: Path) -> Path:
        """The shards volume as the shard writer's container sees it, copied to the host."""
        self.compose("cp", "shards:/data/shards/.", str(dest), capture=True)
        return dest

    def logs_tail(self, lines: int = 40) -> str:
        done = subprocess.run([*self.argv, "logs", "--no-color", "--tail", str(lines)], capture_output=True,
                              text=True, timeout=120, check=False)
        return done.stdout[-12000:] + done.stderr[-2000:]

    def refuse_existing(self) -> None:
        """A project that already has containers or volumes is someone else's (or an earlier run's): not touched."""
        if found := self.remnants():
            raise CheckFailed(f"compose project {self.project} already exists on this daemon ({found[:3]}): "
                              f"not touched; `docker compose -p {self.project} down -v` removes it")

    def remnants(self) -> list[str]:
        """The project's containers, volumes and networks on the daemon."""
        left = []
        for kind in (["ps", "-aq"], ["volume", "ls", "-q"], ["network", "ls", "-q"]):
            done = subprocess.run(["docker", *kind, "--filter", f"label=com.docker.compose.project={self.project}"],
                                  capture_output=True, text=True, check=False)
            left += [f"{kind[0]} {line}" for line in done.stdout.split()]
        return left

    def down(self) -> list[str]:
        """``down -v``; what is left of the project afterwards (nothing, when it came down clean)."""
        # every profile too: a service started from one (the observability profile's Prometheus) is not taken
        # down by a plain `down`
        self.compose("--profile", "observability", "--profile", "tools", "down", "--volumes", "--remove-orphans",
                     "--timeout", "30", capture=True)
        return self.remnants()


def read_topic(conn: dict, topic: str) -> list:
    """Every record of ``topic`` up to its current end (the project's group-less reader: commits nothing)."""
    reader = TopicReader(conn, [topic])
    try:
        return reader.read_to_end(timeout_s=60)[topic]
    finally:
        reader.close()


def turns_partitions(conn: dict) -> int:
    consumer = group_less_consumer(conn)
    try:
        return len(consumer.partitions_for_topic("rollout.turns") or ())
    finally:
        consumer.close()


def end_offsets(conn: dict, topic: str) -> int:
    """Records ever written to ``topic``; 0 while it or a leader of its partitions is not known yet."""
    consumer = group_less_consumer(conn)
    try:
        return sum((partition_offsets(consumer, topic) or {}).values())
    finally:
        consumer.close()


def is_control(record) -> bool:
    return control_kind(record.headers) is not None


def wait_until(what: str, check, timeout_s: float, stack: Stack | None = None, every_s: float = 3.0):
    """Poll ``check()`` until it returns something true; say what is awaited while waiting."""
    deadline, said = time.monotonic() + timeout_s, 0.0
    while True:
        try:
            found = check()
        except (KafkaError, RolloutBusError, OSError) as exc:  # the host's reads while a broker is down: ask again
            say(f"(reading the cluster from the host: {type(exc).__name__}: {exc}; retrying)")
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise CheckFailed(f"gave up after {timeout_s:.0f}s waiting for {what}")
        if time.monotonic() - said > 15:
            say(f"waiting for {what} ...")
            said = time.monotonic()
        if stack is not None:
            for service in ("topics", "generator"):
                state, code = stack.state(service)
                if state == "exited" and code not in (0, None):
                    raise CheckFailed(f"{service} exited {code} while waiting for {what}")
        time.sleep(every_s)


def stream_members(conn: dict) -> list[int] | None:
    """Partitions of rollout.turns per member of the stable stream group (None while it is rebalancing)."""
    admin = KafkaAdminClient(**conn)
    try:
        info = admin.describe_groups([STREAM_GROUP]).get(STREAM_GROUP, {})
    except KafkaError:  # the coordinator is still being elected: ask again
        return None
    finally:
        admin.close()
    if info.get("group_state") != "Stable":
        return None
    return [sum(len(a["partitions"]) for a in (m.get("member_assignment") or {}).get("assigned_partitions", [])
                if a["topic"] == "rollout.turns") for m in info.get("members") or []]


def run_finished(conn: dict) -> bool:
    """The shard writer has put end-of-run on rollout.shards: every batch of the run is written."""
    return any(r.key == b"end-of-run" and is_control(r) for r in read_topic(conn, "rollout.shards"))


def account(stack: Stack, conn: dict, episodes: int, work: Path) -> int:
    """Every episode on rollout.turns in exactly one verified batch, nothing dead-lettered; the batch count."""
    sent = {r.key.decode() for r in read_topic(conn, "rollout.turns") if not is_control(r)}
    shards = stack.copy_shards(work / "shards")
    placed: list[str] = []
    batches = 0
    for batch in sorted(shards.glob("batch-*")):
        if read_manifest(batch) is None:
            continue
        batches += 1
        placed += [e["key"] for e in verify_batch(batch)["extra"]["episodes"]]
    dead = read_topic(conn, "rollout.dlq")
    twice = sorted({k for k in placed if placed.count(k) > 1})
    problems = []
    if len(sent) != episodes:
        problems.append(f"rollout.turns holds {len(sent)} episodes, the generator was asked for {episodes}")
    if twice:
        problems.append(f"{len(twice)} episodes in more than one batch, e.g. {twice[:3]}")
    if set(placed) != sent:
        missing, unknown = sorted(sent - set(placed)), sorted(set(placed) - sent)
        problems.append(f"{len(missing)} sent episodes in no batch (e.g. {missing[:3]}), "
                        f"{len(unknown)} batched episodes never sent (e.g. {unknown[:3]})")
    if dead:
        problems.append(f"{len(dead)} records on rollout.dlq, e.g. {[dict(d.headers) for d in dead[:2]]}")
    if problems:
        raise CheckFailed("; ".join(problems))
    say(f"accounted: {len(sent)} episodes sent, {len(placed)} in {batches} verified batches on the shards volume, "
        "each exactly once; rollout.dlq empty")
    return batches


def check_observers(bootstrap: str, batches: int, env: dict[str, str] | None = None) -> None:
    """The exporter's metrics and ``rollout-bus tail --once --json``, both from the host, see the batches."""
    def exporter_total() -> float | None:
        try:
            text = urllib.request.urlopen(EXPORTER, timeout=5).read().decode()
        except OSError:
            return None
        found = re.search(r"^rollout_batches_total (\S+)$", text, re.M)
        return float(found.group(1)) if found and float(found.group(1)) == batches else None

    total = wait_until(f"the exporter on {EXPORTER} to count {batches} batches", exporter_total, 120)
    say(f"exporter: {EXPORTER} answers, rollout_batches_total {total:.0f}")
    snapshot = json.loads(rollout_bus("tail", "--once", "--json", "--bootstrap-servers", bootstrap,
                                      env=env).splitlines()[-1])
    if snapshot.get("batches") != batches:
        raise CheckFailed(f"tail --once --json saw {snapshot.get('batches')} batches, the volume holds {batches}")
    say(f"tail --once --json against {bootstrap}: {snapshot['batches']} batches, "
        f"{snapshot['batch_samples']} samples, lag rows {len(snapshot['lag'])}")


def single(compose: list[str], episodes: int, keep: bool) -> None:
    stack = Stack(compose, SINGLE_PROJECT, [BASE])
    stack.refuse_existing()
    failed = True
    try:
        say("up: one broker, topics, generator, stream x3, shards, exporter")
        stack.compose("up", "--detach", "--scale", "stream=3")
        shares = wait_until("three stream containers sharing rollout.turns in one group",
                            lambda: (m := stream_members(SINGLE_CONN)) and len(m) == 3 and all(m) and m,
                            300, stack)
        say(f"stream group {STREAM_GROUP}: 3 members with {shares} partitions of rollout.turns; Kafka's tool says:")
        print(rollout_bus("kafka", "tool", "consumer-groups", "--bootstrap-server", SINGLE_BOOTSTRAP,
                          "--describe", "--members", "--verbose", "--group", STREAM_GROUP), flush=True)
        if sum(shares) != (partitions := turns_partitions(SINGLE_CONN)):
            raise CheckFailed(f"the members hold {sum(shares)} partitions, rollout.turns has {partitions}")
        run_to_the_end(stack, SINGLE_CONN)
        with tempfile.TemporaryDirectory(prefix="stack-check-") as work:
            batches = account(stack, SINGLE_CONN, episodes, Path(work))
        check_observers(SINGLE_BOOTSTRAP, batches)
        check_prometheus(stack, batches)
        failed = False
    finally:
        finish(stack, failed, keep)


def prometheus_query(path: str) -> dict:
    """One answer of Prometheus's HTTP API (``/api/v1/...``) on the published port; its ``data``."""
    answer = json.loads(urllib.request.urlopen(f"{PROMETHEUS}{path}", timeout=5).read().decode())
    if answer.get("status") != "success":
        raise CheckFailed(f"Prometheus answered {path} with {answer}")
    return answer["data"]


def check_prometheus(stack: Stack, batches: int) -> None:
    """The observability profile's Prometheus, asked from the host: its rollout-bus and own targets up, the alert
    rules loaded, and ``rollout_batches_total`` as many as the batches on the shards volume."""
    say("up: the observability profile's Prometheus (Grafana stays down: no local image of it)")
    stack.compose("--profile", "observability", "up", "--detach", "prometheus", capture=True)

    def targets_up() -> list[str] | None:
        try:
            active = prometheus_query("/api/v1/targets")["activeTargets"]
        except OSError:
            return None
        up = [f"{t['labels']['job']} {t['scrapeUrl']}" for t in active if t["health"] == "up"]
        return up if len(up) == len(active) == 2 else None

    up = wait_until("Prometheus's two targets (rollout-bus, itself) up", targets_up, 120, stack)
    say(f"Prometheus targets up: {up}")

    def batches_seen() -> float | None:
        try:
            result = prometheus_query("/api/v1/query?query=rollout_batches_total")["result"]
        except OSError:
            return None
        return float(result[0]["value"][1]) if result and float(result[0]["value"][1]) == batches else None

    seen = wait_until(f"Prometheus to read rollout_batches_total {batches}", batches_seen, 120, stack)
    rules = [r["name"] for g in prometheus_query("/api/v1/rules")["groups"] for r in g["rules"]]
    firing = [a["labels"]["alertname"] for a in prometheus_query("/api/v1/alerts")["alerts"]
              if a["state"] == "firing"]
    if not rules or firing:
        raise CheckFailed(f"alert rules loaded: {rules}; firing after a clean run: {firing}")
    say(f"Prometheus: rollout_batches_total {seen:.0f} = the {batches} batches on the volume; {len(rules)} alert "
        f"rules loaded, none firing")


def secure(compose: list[str], episodes: int, keep: bool) -> None:
    secrets = ComposeSecrets(Path(os.environ["ROLLOUT_BUS_SECRETS_DIR"]))
    setup = secrets.setup
    observer = setup.client_kwargs("observer", SINGLE_BOOTSTRAP)
    stack = Stack(compose, SECURE_PROJECT, [BASE, SECURE])
    stack.refuse_existing()
    failed = True
    try:
        say("up: one secured broker (SASL_SSL, SCRAM, ACLs), credentials, topics, acls, generator, stream, shards, "
            "exporter; each stage its role's principal")
        stack.compose("up", "--detach")
        run_to_the_end(stack, observer)
        say("the ACLs as the broker reports them (`rollout-bus acl list`, the acls one-shot's output):")
        print(stack.compose("logs", "--no-color", "--no-log-prefix", "acls", capture=True), flush=True)
        with tempfile.TemporaryDirectory(prefix="stack-check-") as work:
            batches = account(stack, observer, episodes, Path(work))
        check_observers(SINGLE_BOOTSTRAP, batches, env=setup.client_env("observer", SINGLE_BOOTSTRAP))
        check_refusals(setup)
        check_no_password(stack, setup)
        failed = False
    finally:
        finish(stack, failed, keep)


def check_refusals(setup) -> None:
    """From the host: no TLS is refused with its reason, and the generator may not write rollout.weights."""
    try:
        new_admin({"bootstrap_servers": SINGLE_BOOTSTRAP}, bootstrap_timeout_ms=4000, request_timeout_ms=4000).close()
        raise CheckFailed(f"a PLAINTEXT client without credentials was let in at {SINGLE_BOOTSTRAP}")
    except BrokerError as exc:
        if "speaks TLS and this client is set for PLAINTEXT" not in str(exc):
            raise CheckFailed(f"a PLAINTEXT client was refused, but not as expected: {exc}") from exc
    say("refused: a PLAINTEXT client without credentials (the probe says the listener speaks TLS)")
    publisher = WeightPublisher(setup.client_kwargs("generator", SINGLE_BOOTSTRAP), Topics())
    try:
        publisher.publish(1, 1)
        raise CheckFailed("the generator principal published a weight version")
    except AccessDenied as exc:
        say(f"refused: {exc}")
    finally:
        publisher.close()
    if (n := end_offsets(setup.client_kwargs("observer", SINGLE_BOOTSTRAP), "rollout.weights")) != 0:
        raise CheckFailed(f"rollout.weights holds {n} records after the refused publish")


def check_no_password(stack: Stack, setup) -> None:
    """No principal's password in the resolved compose model, any container's environment or command, the logs
    or the exporter's series and labels."""
    passwords = {u: setup.password(u) for u in setup.users()}
    model = stack.compose("config", capture=True)
    ids = stack.compose("ps", "--all", "--quiet", capture=True).split()
    inspected = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True).stdout
    logs = stack.compose("logs", "--no-color", capture=True)
    metrics = urllib.request.urlopen(EXPORTER, timeout=5).read().decode()  # its series and their labels
    leaks = [f"{user}'s password in {where}" for user, password in passwords.items()
             for where, text in (("the compose model", model), ("docker inspect", inspected), ("the logs", logs),
                                 ("the exporter's metrics", metrics))
             if password in text]
    if leaks:
        raise CheckFailed("; ".join(leaks))
    say(f"no password of {len(passwords)} principals in the compose model, {len(ids)} containers' inspect "
        f"(environment, command), {len(logs.splitlines())} log lines or the exporter's "
        f"{len(metrics.splitlines())} metric lines")


def run_to_the_end(stack: Stack, conn: dict) -> None:
    wait_until("the generator to exit", lambda: stack.state("generator")[0] == "exited", 600, stack)
    state, code = stack.state("generator")
    if code != 0:
        raise CheckFailed(f"the generator exited {code}")
    say("generator exited 0: every record it sent was acknowledged")
    wait_until("end-of-run on rollout.shards (the last batch written)", lambda: run_finished(conn), 600, stack)


def cluster(compose: list[str], episodes: int, keep: bool) -> None:
    stack = Stack(compose, CLUSTER_PROJECT, [BASE, CLUSTER])
    stack.refuse_existing()
    failed = True
    try:
        say("up: three brokers, topics, generator, stream, shards, exporter")
        stack.compose("up", "--detach")
        sent_before = wait_until("the generator's first turns on rollout.turns",
                                 lambda: end_offsets(CLUSTER_CONN, "rollout.turns"), 300, stack, every_s=0.5)
        if stack.state("generator")[0] != "running":
            raise CheckFailed("the generator finished before a broker could be killed mid-run: raise --episodes")
        stack.compose("kill", "--signal", "SIGKILL", "kafka-2", capture=True)
        say(f"killed kafka-2 (SIGKILL) with {sent_before} records on rollout.turns and the generator running")
        grown = wait_until("writes to go on with two brokers",
                           lambda: (n := end_offsets(CLUSTER_CONN, "rollout.turns")) > sent_before + 100 and n
                           or stack.state("generator")[0] == "exited" and n, 300, stack, every_s=1)
        state, _ = stack.state("kafka-2")
        say(f"rollout.turns at {grown} records with kafka-2 {state}; starting kafka-2 again")
        stack.compose("start", "kafka-2", capture=True)
        run_to_the_end(stack, CLUSTER_CONN)
        with tempfile.TemporaryDirectory(prefix="stack-check-") as work:
            batches = account(stack, CLUSTER_CONN, episodes, Path(work))
        check_observers(CLUSTER_BOOTSTRAP, batches)
        check_replication(CLUSTER_BOOTSTRAP)
        failed = False
    finally:
        finish(stack, failed, keep)


def check_replication(bootstrap: str) -> None:
    """Every topic (the pipeline's, the stream's changelog, Kafka's own) with replication factor 3,
    ``min.insync.replicas=2`` and all three replicas in sync again, as Kafka's own topics and configs tools
    describe them."""
    wait_until("no under-replicated partition (kafka-2 caught up)",
               lambda: rollout_bus("kafka", "tool", "topics", "--bootstrap-server", bootstrap, "--describe",
                                   "--under-replicated-partitions").strip() == "", 300)
    described = rollout_bus("kafka", "tool", "topics", "--bootstrap-server", bootstrap, "--describe")
    topics: dict[str, dict] = {}
    for line in described.splitlines():
        if head := re.match(r"Topic: (\S+)\tTopicId: .*\tReplicationFactor: (\d+)\t", line):
            topics[head.group(1)] = {"rf": head.group(2), "min_isr": None, "isr": []}
        elif part := re.match(r"\tTopic: (\S+)\tPartition: \d+\t.*\tIsr: (\S+)", line):
            topics[part.group(1)]["isr"].append(len(part.group(2).split(",")))
    configs = rollout_bus("kafka", "tool", "configs", "--bootstrap-server", bootstrap, "--describe", "--all",
                          "--entity-type", "topics")  # the effective value, wherever it is set
    for name, value in re.findall(r"^All configs for topic (\S+) are:\n(?:  .*\n)*?  min\.insync\.replicas=(\d+) ",
                                  configs, re.M):
        if name in topics:
            topics[name]["min_isr"] = value
    missing = [t for t in PIPELINE_TOPICS if t not in topics]
    wrong = {t: v for t, v in topics.items() if v["rf"] != "3" or v["min_isr"] != "2" or min(v["isr"], default=0) != 3}
    if missing or wrong:
        raise CheckFailed(f"topics missing {missing}; not RF 3 / min ISR 2 / ISR 3: {wrong}\n{described}")
    for name, topic in sorted(topics.items()):
        say(f"{name}: {len(topic['isr'])} partitions, ReplicationFactor 3, min.insync.replicas=2, "
            "every ISR of 3")
    print("\n".join(line for line in described.splitlines() if "rollout.episodes" in line), flush=True)


def finish(stack: Stack, failed: bool, keep: bool) -> None:
    if failed:
        say(f"FAILED; the last log lines of {stack.project}:")
        print(stack.logs_tail(), flush=True)
    if keep:
        say(f"--keep: {stack.project} is left up (docker compose -p {stack.project} down -v removes it)")
        return
    left = stack.down()
    if left:
        raise CheckFailed(f"{stack.project} did not come down clean: {left}")
    say(f"down -v: {stack.project} left no container, volume or network")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", choices=["single", "cluster", "secure"])
    parser.add_argument("--compose", required=True, help="the compose command, e.g. 'docker compose'")
    parser.add_argument("--episodes", type=int, required=True, help="ROLLOUT_BUS_EPISODES the stack was given")
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    args = parser.parse_args(argv)
    os.environ["ROLLOUT_BUS_EPISODES"] = str(args.episodes)
    began = time.monotonic()
    try:
        {"single": single, "cluster": cluster, "secure": secure}[args.run](args.compose.split(), args.episodes,
                                                                            args.keep)
    except CheckFailed as exc:
        say(f"FAILED ({args.run}, {time.monotonic() - began:.0f}s): {exc}")
        return 1
    say(f"passed ({args.run}) in {time.monotonic() - began:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
