"""A real three-node Apache Kafka cluster (KRaft) on 127.0.0.1, for fault drills that need replicas.

Each node is a combined broker+controller managed exactly like ``LocalBroker`` (same jars, same
launch, pid guard, stop and log handling): node ``i`` listens on ``ports[i]`` and its controller on
``ports[i] + 1``; the controller quorum is static (every node a voter), and all nodes are formatted
with one cluster id, kept in ``{data_dir}/cluster.id`` so a restart reuses the formatted dirs.
Cluster defaults: replication factor 3 and ``min.insync.replicas`` 2 (internal topics too), so
``acks=all`` writes survive the loss of any one node. A node's heap is small (``NODE_HEAP``) because
three JVMs share one machine; a lost broker is fenced after ``broker.session.timeout.ms`` (6 s).

Contract: ``start`` launches the nodes that are down, together (a lone node cannot form a quorum),
and returns once every node answers a metadata request; ``stop`` stops them all. ``kill(node)``
is kill -9, ``stop_node``/``start_node`` are a clean stop and a start of one node; ``leader`` says
which node leads a topic-partition; ``rolling_restart`` restarts every node in turn, waiting until
every partition is fully replicated again before the next. ``LocalCluster(..., secure=True)`` is secured
as ``LocalBroker(secure=True)`` is (``local_kafka.secure``): one CA, broker certificate and set of principals
for all nodes, the nodes talking to each other over TLS (controllers) and SASL_SSL as ``admin`` (brokers),
each role granted its ACLs once every node is up; ``connection()`` is the admin's client settings.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rollout_bus.errors import BrokerError, ConfigError, must_be
from rollout_bus.local_kafka import runtime
from rollout_bus.local_kafka.certificates import write_private
from rollout_bus.local_kafka.local_broker import (LOG4J2, BrokerStatus, LocalBroker, _alive, format_storage,
                                                new_cluster_id, port_is_free, server_properties)
from rollout_bus.local_kafka.secure import ADMIN, SecureSetup

logger = logging.getLogger(__name__)

NODES = 3
NODE_HEAP = "-Xmx384m"
CLUSTER_SETTINGS = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    # a killed node is fenced (and its partitions led elsewhere) after 6 s instead of 9 s
    "broker.session.timeout.ms": "6000",
    "broker.heartbeat.interval.ms": "1000",
}


def cluster_properties(node_id: int, port: int, data: Path, voters: str,
                       overrides: dict[str, str] | None = None) -> str:
    """The single-node configuration of ``server_properties`` (with ``overrides``: a secured node's) with this
    node's id, the static voters and the cluster's replication defaults."""
    settings = dict(line.split("=", 1) for line in server_properties(port, port + 1, data, overrides).splitlines()
                    if "=" in line)
    settings.update(CLUSTER_SETTINGS)
    settings["node.id"] = str(node_id)
    settings["controller.quorum.voters"] = voters
    return "".join(f"{k}={v}\n" for k, v in settings.items())


class ClusterNode(LocalBroker):
    """One node of a ``LocalCluster``: ``LocalBroker``'s lifecycle with the cluster's configuration."""

    heap = NODE_HEAP

    def __init__(self, node_id: int, port: int, data_dir: Path, voters: str, cluster_id: Callable[[], str],
                 secure: SecureSetup | None = None):
        super().__init__(port=port, data_dir=data_dir)
        self.node_id = node_id
        self.voters = voters
        self._cluster_id = cluster_id
        self.secure = secure  # the cluster's material, one for every node (the certificate names 127.0.0.1)

    def _prepare(self, java: str, libs: Path) -> None:
        """Write this node's configuration; format its storage with the cluster's id (and, secured, every
        principal's credentials) once."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        overrides = self.secure.server_settings(self.port, self.controller_port) if self.secure else None
        write_private(self.properties, cluster_properties(self.node_id, self.port, self.data_dir, self.voters, overrides))
        (self.data_dir / "log4j2.properties").write_text(LOG4J2)
        if not (self.data_dir / "data" / "meta.properties").exists():
            format_storage(java, libs, self.properties, self._cluster_id(),
                           self.secure.scram_format_args() if self.secure else ())

    def _open_to_roles(self) -> None:
        """The cluster opens to the roles once every node is up (``LocalCluster.start``)."""

    def pid(self) -> int | None:
        return self._recorded_pid()

    def wait_ports_released(self, timeout_s: float = 10.0) -> None:
        """Wait until both listeners are closed. A JVM's main thread may be reported a zombie (so
        ``stop`` returns) while its other threads still hold the sockets; starting again at once
        would find the ports taken."""
        deadline = time.monotonic() + timeout_s
        while not (port_is_free(self.port) and port_is_free(self.controller_port)):
            if time.monotonic() > deadline:
                raise BrokerError(f"ports {self.port}/{self.controller_port} of node {self.node_id} are still "
                                  f"taken {timeout_s:.0f}s after it stopped")
            time.sleep(0.05)


class LocalCluster:
    """Three combined broker+controller nodes on 127.0.0.1; node ids are 1, 2, 3.

    Ports: either ``ports`` (one per node) or ``base_port`` (nodes on ``base_port``, ``+2``, ``+4``;
    each controller on its node's port + 1). ``data_dir`` defaults to ``{cache}/cluster-{first port}``.
    """

    def __init__(self, ports: tuple[int, ...] | list[int] | None = None, data_dir: Path | str | None = None,
                 echo: Callable[[str], None] = print, *, base_port: int | None = None, secure: bool = False):
        if (ports is None) == (base_port is None):
            raise ConfigError(must_be("ports or base_port", "exactly one of them", (ports, base_port)))
        if base_port is not None:
            ports = [base_port + 2 * i for i in range(NODES)]
        ports = tuple(int(p) for p in ports)
        taken = [q for p in ports for q in (p, p + 1)]
        if len(ports) != NODES or len(set(taken)) != len(taken) or not all(1 <= p <= 65534 for p in ports):
            raise ConfigError(must_be("ports", f"{NODES} ports in 1..65534, each with port + 1 free for its "
                                               "controller and no two overlapping", ports))
        self.ports = ports
        self.data_dir = Path(data_dir).expanduser() if data_dir else runtime.cache_root() / f"cluster-{ports[0]}"
        self.echo = echo
        voters = ",".join(f"{i}@127.0.0.1:{p + 1}" for i, p in enumerate(ports, start=1))
        # secured as ``LocalBroker(secure=True)`` is, and for good once its material exists
        material = self.data_dir / "secure"
        self.secure = SecureSetup(material) if secure or material.exists() else None
        self.nodes = {i: ClusterNode(i, p, self.data_dir / f"node-{i}", voters, self._cluster_id, self.secure)
                      for i, p in enumerate(ports, start=1)}

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes.values())

    def _cluster_id(self) -> str:
        path = self.data_dir / "cluster.id"
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(new_cluster_id() + "\n")
        return path.read_text().strip()

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def node(self, node_id: int) -> ClusterNode:
        if node_id not in self.nodes:
            raise ConfigError(must_be("node id", f"one of {sorted(self.nodes)}", node_id))
        return self.nodes[node_id]

    def connection(self, bootstrap: str | None = None) -> dict[str, Any]:
        """kafka-python keywords of a client of the cluster (secured: its ``admin`` principal)."""
        bootstrap = bootstrap or self.bootstrap
        return self.secure.client_kwargs(ADMIN, bootstrap) if self.secure else {"bootstrap_servers": bootstrap}

    def live_bootstrap(self) -> str:
        """Bootstrap servers of the nodes whose process runs (all of them when none does)."""
        live = [n.bootstrap for n in self.nodes.values() if n.pid() is not None]
        return ",".join(live) or self.bootstrap

    def status(self) -> dict[int, BrokerStatus]:
        return {i: node.status() for i, node in self.nodes.items()}

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every node that is down, in parallel (a quorum needs two voters), and wait for all."""
        self._cluster_id()  # before the threads: one id, written once
        runtime.ensure_jars(echo=self.echo)
        if self.secure is not None:  # one CA, certificate and set of principals, before any node formats
            self.secure.prepare(runtime.java_executable())
        errors: dict[int, BaseException] = {}

        def start_one(node: ClusterNode) -> None:
            try:
                node.start(timeout_s=timeout_s, echo=self.echo)
            except BaseException as exc:  # reported below, after every thread is done
                errors[node.node_id] = exc

        began = time.monotonic()
        threads = [threading.Thread(target=start_one, args=(n,), daemon=True) for n in self.nodes.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.stop()
            raise BrokerError("the local cluster did not start: " + "; ".join(
                f"node {i}: {exc}" for i, exc in sorted(errors.items())))
        if self.secure is not None:
            self.secure.open_to_roles(self.bootstrap, self.connection())
        logger.info("local cluster up bootstrap=%s seconds=%.1f", self.bootstrap, time.monotonic() - began)

    def stop(self, timeout_s: float = 20.0, last_timeout_s: float = 5.0) -> None:
        """Stop every node, one after another (SIGKILL for one that lingers past ``timeout_s``).

        The last node running cannot finish a controlled shutdown (no quorum is left to grant
        it; it would wait forever), so it gets only ``last_timeout_s`` before SIGKILL.
        """
        running = [n for n in self.nodes.values() if n.pid() is not None]
        for i, node in enumerate(running):
            node.stop(last_timeout_s if i == len(running) - 1 else timeout_s)
            node.wait_ports_released()

    def kill(self, node_id: int) -> None:
        """kill -9 one node and wait until its process is gone."""
        node = self.node(node_id)
        pid = node.pid()
        if pid is None:
            raise BrokerError(f"node {node_id} of the local cluster is not running; nothing to kill")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        node.pid_file.unlink(missing_ok=True)
        node.wait_ports_released()
        logger.info("killed node=%d pid=%d", node_id, pid)

    def stop_node(self, node_id: int, timeout_s: float = 30.0) -> bool:
        """A clean stop of one node (controlled shutdown: its partitions move away first)."""
        stopped = self.node(node_id).stop(timeout_s)
        self.node(node_id).wait_ports_released()
        return stopped

    def start_node(self, node_id: int, timeout_s: float = 90.0) -> BrokerStatus:
        """Start one node (the others must hold the quorum) and wait until it answers."""
        return self.node(node_id).start(timeout_s=timeout_s, echo=self.echo)

    def describe(self, topics: list[str] | None = None, timeout_s: float = 30.0) -> list[dict]:
        """kafka-python's ``describe_topics`` of ``topics`` (every topic when None), from a live node.

        Until a killed node is fenced, the metadata still names it and a request may go to it and be
        refused: such requests are retried on another client until ``timeout_s``.
        """
        from rollout_bus.kafka.clients import KafkaError, new_admin  # a heavy import, only needed here

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                admin = new_admin(self.connection(self.live_bootstrap()), client_id="rollout-bus-cluster",
                                  request_timeout_ms=5_000)
                try:
                    return admin.describe_topics(topics)
                finally:
                    admin.close()
            except (KafkaError, BrokerError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise BrokerError(f"the local cluster did not describe {topics or 'its topics'} in "
                                      f"{timeout_s:.0f}s: {exc}") from exc
                time.sleep(0.5)

    def leader(self, topic: str, partition: int = 0) -> int | None:
        """The node id leading ``topic``/``partition`` now; None while it has no leader (or no such topic)."""
        for found in self.describe([topic]):
            for part in found.get("partitions", []):
                if part["partition_index"] == partition and part["leader_id"] >= 0:
                    return int(part["leader_id"])
        return None

    def under_replicated(self, topics: list[str] | None = None) -> list[tuple[str, int]]:
        """Partitions whose in-sync replicas are fewer than their replicas (or that have no leader)."""
        short = []
        for found in self.describe(topics):
            for part in found.get("partitions", []):
                if part["leader_id"] < 0 or set(part["isr_nodes"]) != set(part["replica_nodes"]):
                    short.append((found["name"], part["partition_index"]))
        return sorted(short)

    def wait_fully_replicated(self, timeout_s: float = 90.0, topics: list[str] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        short: list[tuple[str, int]] = []
        while time.monotonic() < deadline:
            try:
                short = self.under_replicated(topics)
            except Exception as exc:  # a node just restarted may refuse a request or two
                short = [(f"(describe failed: {exc})", -1)]
            if not short:
                return
            time.sleep(0.5)
        raise BrokerError(f"partitions still under-replicated after {timeout_s:.0f}s: {short[:10]}")

    def rolling_restart(self, order: list[int] | None = None, settle_timeout_s: float = 90.0,
                        on_restarted: Callable[[int], None] | None = None) -> dict[int, float]:
        """Stop and start each node in turn; before the next, wait until every partition is fully
        replicated again. Returns the seconds each node took (stop to fully replicated)."""
        took = {}
        for node_id in order or sorted(self.nodes):
            began = time.monotonic()
            self.stop_node(node_id)
            self.start_node(node_id)
            self.wait_fully_replicated(settle_timeout_s)
            took[node_id] = time.monotonic() - began
            logger.info("rolling restart node=%d seconds=%.1f", node_id, took[node_id])
            if on_restarted is not None:
                on_restarted(node_id)
        return took

    def log_tail(self, node_id: int, lines: int = 30) -> str:
        return self.node(node_id).log_tail(lines)


# Below Linux's ephemeral range (32768-60999; also below the 49152+ of macOS and Windows). A broker that is
# stopped and started again on a port inside that range can find it taken meanwhile by some client's
# outgoing connection, even by a client reconnecting to that very port (a TCP self-connect): the chaos
# suite's 120 s outage once failed so on port 40400.
FREE_PORT_RANGE = (31000, 31999)


def free_ports(count: int = NODES, low: int = FREE_PORT_RANGE[0], high: int = FREE_PORT_RANGE[1]) -> list[int]:
    """``count`` ports in ``[low, high)`` with ``port + 1`` free too (for the controller), none
    overlapping; a random start so concurrent users of one machine rarely collide."""
    found: list[int] = []
    start = random.randrange(low, high)
    for offset in range(0, high - low, 2):
        port = low + (start - low + offset) % (high - low - 1)
        if any(abs(port - p) < 2 for p in found):
            continue
        if port_is_free(port) and port_is_free(port + 1):
            found.append(port)
            if len(found) == count:
                return found
    raise BrokerError(f"no {count} free port pairs between {low} and {high} on 127.0.0.1")
