"""A real single-node Apache Kafka (KRaft, broker+controller) on 127.0.0.1, managed by pid.

State lives in one data directory: ``server.properties``, ``log4j2.properties``, ``data/``
(the log dirs), ``broker.log`` and ``broker.pid``. ``start`` formats storage on first use,
launches ``kafka.Kafka`` in its own session, and returns only once the broker answers a metadata
request; it is a no-op when the broker it started is already up. ``stop`` signals only the pid it
recorded, after checking that pid still runs *this* broker. Settings are tuned for a quick start
on a small machine: replication factor and min ISR 1, no initial rebalance delay, one-partition
internal topics.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.errors import BrokerError, ConfigError, must_be
from rollout_bus.local_kafka import runtime
from rollout_bus.local_kafka.certificates import write_private
from rollout_bus.local_kafka.secure import ADMIN, SecureSetup

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9092
HEAP = "-Xmx768m"

LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
logger.raft.name = org.apache.kafka.raft
logger.raft.level = WARN
logger.ctrl.name = org.apache.kafka.controller
logger.ctrl.level = WARN
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
"""


def server_properties(port: int, controller_port: int, data: Path, overrides: Mapping[str, str] | None = None) -> str:
    """The broker's configuration: one combined node, everything sized for one machine; ``overrides`` replace
    settings (a secured node's listeners, ``secure.SecureSetup.server_settings``) or add to them."""
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data / "data"),
        "num.partitions": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "share.coordinator.state.topic.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "true",
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.recovery.threads.per.data.dir": "1",
        "log.retention.hours": "24",
        "log.segment.bytes": str(64 * 1024 * 1024),
    }
    settings.update(overrides or {})
    return "".join(f"{k}={v}\n" for k, v in settings.items())


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def broker_answers(bootstrap: str, timeout_s: float = 2.0, connection: Mapping[str, Any] | None = None) -> bool:
    """True when a broker at ``bootstrap`` answers a metadata request (``connection``: the security keywords
    of a client it accepts)."""
    from rollout_bus.kafka.clients import KafkaError, new_admin  # a heavy import, only needed here

    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:  # nothing listening: answer at once instead of waiting out the client's bootstrap retries
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    quiet = logging.getLogger("kafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        admin = new_admin({**(connection or {}), "bootstrap_servers": bootstrap}, client_id="rollout-bus-probe",
                          request_timeout_ms=int(timeout_s * 1000), bootstrap_timeout_ms=int(timeout_s * 1000))
        try:
            admin.describe_cluster()
            return True
        finally:
            admin.close()
    except (KafkaError, BrokerError, OSError, ValueError):
        return False
    finally:
        quiet.setLevel(level)


@dataclass(frozen=True)
class BrokerStatus:
    up: bool
    pid: int | None
    bootstrap: str
    data_dir: Path
    detail: str


class LocalBroker:
    """One managed broker, identified by its data directory and port."""

    heap = HEAP  # the JVM's -Xmx; a subclass running several nodes on one machine asks for less

    def __init__(self, port: int = DEFAULT_PORT, data_dir: Path | str | None = None, secure: bool = False):
        if not 1 <= port <= 65534:  # the controller listens on port + 1
            raise ConfigError(must_be("port", "in 1..65534 (the controller takes port + 1)", port))
        self.port = port
        self.controller_port = port + 1
        self.data_dir = Path(data_dir).expanduser() if data_dir else runtime.cache_root() / f"broker-{port}"
        self.pid_file = self.data_dir / "broker.pid"
        self.log_file = self.data_dir / "broker.log"
        self.properties = self.data_dir / "server.properties"
        # secured once, secured for good: a data dir formatted with credentials starts secured without the flag
        material = self.data_dir / "secure"
        self.secure = SecureSetup(material) if secure or material.exists() else None
        self._secure_asked = secure

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def connection(self) -> dict[str, Any]:
        """kafka-python keywords of a client of this broker: for a secured one, its ``admin`` principal."""
        if self.secure is None:
            return {"bootstrap_servers": self.bootstrap}
        return self.secure.client_kwargs(ADMIN, self.bootstrap)

    def _answers(self, timeout_s: float = 2.0) -> bool:
        return broker_answers(self.bootstrap, timeout_s, self.connection())

    def _recorded_pid(self) -> int | None:
        """The pid this manager started, if it still runs this broker (guards against pid reuse)."""
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        if b"kafka.Kafka" in cmdline and str(self.properties).encode() in cmdline:
            try:  # a zombie (killed, not yet reaped) is not a running broker
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return None
            return None if state == "Z" else pid
        return None

    def status(self) -> BrokerStatus:
        pid = self._recorded_pid()
        if pid is None:
            return BrokerStatus(False, None, self.bootstrap, self.data_dir, "not running")
        if not self._answers():
            return BrokerStatus(False, pid, self.bootstrap, self.data_dir, f"process {pid} runs but does not answer")
        return BrokerStatus(True, pid, self.bootstrap, self.data_dir, f"up (pid {pid})")

    def start(self, timeout_s: float = 90.0, echo=print) -> BrokerStatus:
        """Start the broker (fetching jars on first use) and wait until it serves metadata."""
        pid = self._recorded_pid()
        if pid is not None:
            if self._answers():
                return BrokerStatus(True, pid, self.bootstrap, self.data_dir, f"already up (pid {pid})")
            return self._wait_until_up(pid, time.monotonic() + timeout_s, echo)
        java = runtime.java_executable()
        for port in (self.port, self.controller_port):
            if not port_is_free(port):
                raise BrokerError(
                    f"port {port} on 127.0.0.1 is taken by another process; stop it, choose another "
                    f"port with --port, or use that cluster with --bootstrap-servers {self.bootstrap}"
                )
        libs = runtime.ensure_jars(echo=echo)
        self._prepare(java, libs)
        log = open(self.log_file, "ab")
        cmd = [java, self.heap, "-Xms256m", "-XX:+UseG1GC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
               f"-Dkafka.logs.dir={self.data_dir}", "-cp", runtime.classpath(libs), "kafka.Kafka", str(self.properties)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.data_dir)
        log.close()
        self.pid_file.write_text(f"{proc.pid}\n")
        return self._wait_until_up(proc.pid, time.monotonic() + timeout_s, echo, proc=proc)

    def _prepare(self, java: str, libs: Path) -> None:
        """Write the configuration and format storage once (KRaft needs a formatted log dir); a secured node's
        certificates and credentials are made first, and its principals created by the format."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        formatted = (self.data_dir / "data" / "meta.properties").exists()
        if self.secure is not None:
            if formatted and not self.secure.directory.exists():
                raise ConfigError(f"{self.data_dir} holds a broker formatted without --secure, and its principals "
                                  f"can only be created by a format: use another --data-dir for a secured broker")
            self.secure.prepare(java)
        overrides = self.secure.server_settings(self.port, self.controller_port) if self.secure else None
        write_private(self.properties, server_properties(self.port, self.controller_port, self.data_dir, overrides))
        (self.data_dir / "log4j2.properties").write_text(LOG4J2)
        if formatted:
            return
        format_storage(java, libs, self.properties, new_cluster_id(),
                       self.secure.scram_format_args() if self.secure else ())

    def _wait_until_up(self, pid: int, deadline: float, echo, proc: subprocess.Popen | None = None) -> BrokerStatus:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(f"the Kafka broker exited with code {proc.returncode} while starting; "
                                  f"last lines of {self.log_file}:\n{self.log_tail()}")
            if self._answers(timeout_s=1.0):
                if self.secure is not None:
                    self._open_to_roles()
                return BrokerStatus(True, pid, self.bootstrap, self.data_dir, f"started (pid {pid})")
            time.sleep(0.25)
        self._signal_and_wait(pid, 10.0)
        raise BrokerError(f"the Kafka broker did not answer on {self.bootstrap} in time; "
                          f"last lines of {self.log_file}:\n{self.log_tail()}")

    def _open_to_roles(self) -> None:
        """A secured node that answers: its principals' client files and each role's ACLs."""
        self.secure.open_to_roles(self.bootstrap, self.connection())

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker this manager started; False when none was running."""
        pid = self._recorded_pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)  # a stale pid file of a broker that died
            return False
        self._signal_and_wait(pid, timeout_s)
        self.pid_file.unlink(missing_ok=True)
        return True

    def _signal_and_wait(self, pid: int, timeout_s: float) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL if it lingers."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log written)"


def new_cluster_id(random_bytes: Callable[[], bytes] = lambda: uuid.uuid4().bytes) -> str:
    """A random KRaft cluster id (22 url-safe base64 characters) that never starts with '-'.

    One random id in 64 would, and Kafka's own command-line tools read ``-t -xyz`` as a missing
    value followed by an option; ``format_storage`` copes with such ids, a person typing one does not.
    """
    while True:
        found = base64.urlsafe_b64encode(random_bytes()).rstrip(b"=").decode()
        if not found.startswith("-"):
            return found


def format_storage(java: str, libs: Path, properties: Path, cluster_id: str,
                   secret_args: Sequence[str] = ()) -> None:
    """Format the log dirs named in ``properties`` for ``cluster_id`` (KRaft refuses unformatted dirs).

    Every node of one cluster must be formatted with the same id; ``--ignore-formatted`` makes a
    second call on a formatted node a no-op. Any valid id works, one starting with '-' included
    (a cluster id file written by hand or by an older version may hold one). ``secret_args`` (SCRAM
    credentials) reach the tool through a JVM argument file readable by its owner only, deleted after, so
    they are never on a command line.
    """
    tool = ["-cp", runtime.classpath(libs), "kafka.tools.StorageTool", "format",
            # one token: the tool's parser would read a separate value starting with '-' as an option
            f"--cluster-id={cluster_id}", "-c", str(properties), "--ignore-formatted", *secret_args]
    argfile = properties.parent / "format.args"
    write_private(argfile, "".join('"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"\n' for a in tool))
    cmd = [java, "-Xmx256m", "-XX:TieredStopAtLevel=1",
           f"-Dlog4j2.configurationFile={properties.parent / 'log4j2.properties'}", f"@{argfile}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    finally:
        argfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise BrokerError(f"formatting Kafka storage failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap our own child if it exited
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class BrokerLease:
    """Use the given cluster, or start the local broker for the duration and stop it afterwards.

    A broker that was already up before the lease is left running: the lease stops only what it started.
    """

    def __init__(self, bootstrap_servers: str | None, port: int = DEFAULT_PORT, data_dir: Path | None = None,
                 echo=print, secure: bool = False):
        self.given = bootstrap_servers or None
        if secure and data_dir is None:  # never the plaintext broker's dir: a secured one is formatted so
            data_dir = runtime.cache_root() / f"broker-{port}-secure"
        self.broker = None if self.given else LocalBroker(port=port, data_dir=data_dir, secure=secure)
        self.started_here = False
        self.echo = echo

    def __enter__(self) -> str:
        if self.given:
            return self.given
        began = time.monotonic()
        status = self.broker.start(echo=self.echo)
        self.started_here = not status.detail.startswith("already")
        self.echo(f"local kafka {status.detail} at {status.bootstrap} ({time.monotonic() - began:.1f}s)")
        return status.bootstrap

    def __exit__(self, *exc) -> None:
        if self.broker is not None and self.started_here:
            self.broker.stop()
            self.echo("local kafka stopped")
