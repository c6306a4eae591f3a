"""The secured local broker (``kafka start --secure``): every refusal of the matrix, tested against it.

One secured broker (SASL_SSL, SCRAM-SHA-512, ``StandardAuthorizer`` refusing what no ACL allows) on a free
port and a data directory of this module, started by the CLI as a user would. Each cell is a client x an
action: a login the broker must refuse (no TLS, a wrong password, a CA that did not sign the broker's
certificate), an action a role's ACLs must refuse (the generator writing rollout.weights or reading
rollout.shards, the observer producing, a run's principal reading another run's prefix), and the allowed
ones beside them. A refusal must reach the person as one line naming what was refused, as whom, and what
to check, and nothing may be written; an allowed action must work.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollout_bus.errors import AccessDenied, BrokerError
from rollout_bus.consumers.feed.weights import WeightPublisher, WeightWatcher
from rollout_bus.kafka.acls import apply_bindings, list_bindings, role_bindings
from rollout_bus.kafka.admin import ensure_topics, wait_for_cluster
from rollout_bus.kafka.clients import new_admin, new_producer
from rollout_bus.local_kafka.certificates import keytool_beside, make_authority
from rollout_bus.local_kafka.local_broker import LocalBroker
from rollout_bus.local_kafka.local_cluster import free_ports
from rollout_bus.local_kafka.runtime import java_executable
from rollout_bus.local_kafka.secure import ADMIN
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.wire.topics import Topics
from tests.integration.pipeline_harness import run_pipeline, shard_digests

LOGIN_TIMEOUT_MS = 4000  # a refused login is told apart by the probe, not by waiting out the client


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


class Secured:
    """The module's secured broker: its manager, what `kafka start --secure` printed, and clients per principal."""

    def __init__(self, broker: LocalBroker, started: subprocess.CompletedProcess) -> None:
        self.broker, self.started = broker, started
        self.setup = broker.secure
        assert self.setup is not None

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    def conn(self, user: str) -> dict:
        return self.setup.client_kwargs(user, self.bootstrap)

    def env(self, user: str) -> dict[str, str]:
        return self.setup.client_env(user, self.bootstrap)

    def run_topics(self, **grants: str) -> Topics:
        """Fresh topics under a prefix of their own (created as admin), each ``role=principal`` granted its ACLs."""
        topics = Topics(prefix=f"s{uuid.uuid4().hex[:8]}.")
        ensure_topics(self.conn(ADMIN), topics)
        apply_bindings(self.conn(ADMIN), [(p, b) for role, p in grants.items() for b in role_bindings(role, p, topics)])
        return topics

    def written(self, *names: str) -> dict[str, int]:
        reader = TopicReader(self.conn(ADMIN), list(names))
        try:
            return reader.record_counts(names)
        finally:
            reader.close()


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Secured:
    data = tmp_path_factory.mktemp("secured-broker")
    port = free_ports(1)[0]
    started = _cli("kafka", "start", "--secure", "--port", str(port), "--data-dir", str(data))
    assert started.returncode == 0, started.stderr
    broker = LocalBroker(port=port, data_dir=data)  # secured for good: found by its material, no flag needed
    try:
        yield Secured(broker, started)
    finally:
        broker.stop()


# -- the start: what it tells a person, and what it keeps secret ---------------------------------------------


def test_start_prints_each_principals_settings_file_and_no_password(secured):
    setup = secured.setup
    out = secured.started.stdout + secured.started.stderr
    assert secured.started.stdout.strip() == secured.bootstrap
    assert "SASL_SSL, SCRAM-SHA-512" in out and str(setup.ca_file) in out
    for user in setup.users():
        assert str(setup.env_file(user)) in out
        password = setup.password(user)
        assert len(password) >= 24 and password not in out
        assert password not in setup.env_file(user).read_text()  # the env file names the password's file
        for secret in (setup.password_file(user), setup.env_file(user)):
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    env = dict(line.split("=", 1) for line in setup.env_file("trainer").read_text().splitlines())
    assert env["ROLLOUT_BUS_SASL_PASSWORD_FILE"] == str(setup.password_file("trainer"))
    assert env["ROLLOUT_BUS_SECURITY_PROTOCOL"] == "SASL_SSL" and env["ROLLOUT_BUS_SSL_CAFILE"] == str(setup.ca_file)


def test_no_password_is_in_the_brokers_log_or_a_command_line(secured):
    passwords = [secured.setup.password(u) for u in secured.setup.users()]
    log = secured.broker.log_file.read_text(errors="replace")
    assert "SASL_SSL" in log  # the listener is in the log; its credentials are not
    assert not [p for p in passwords if p in log]
    cmdline = Path(f"/proc/{secured.broker.status().pid}/cmdline").read_bytes().decode(errors="replace")
    assert "kafka.Kafka" in cmdline and not [p for p in passwords if p in cmdline]
    assert not (secured.broker.data_dir / "format.args").exists()  # the credentials' argument file is gone


# -- logins the broker refuses ---------------------------------------------------------------------------------


def _login_refusal(conn: dict) -> str:
    began = time.monotonic()
    with pytest.raises(BrokerError) as refused:
        new_admin(conn, bootstrap_timeout_ms=LOGIN_TIMEOUT_MS, request_timeout_ms=LOGIN_TIMEOUT_MS)
    assert time.monotonic() - began < 20
    text = str(refused.value)
    assert "\n" not in text
    return text


def test_an_unauthenticated_plaintext_client_is_told_the_listener_speaks_tls(secured):
    text = _login_refusal({"bootstrap_servers": secured.bootstrap})
    assert f"{secured.bootstrap} speaks TLS and this client is set for PLAINTEXT: set ROLLOUT_BUS_SECURITY_PROTOCOL" \
           "=SASL_SSL" in text, text


def test_a_wrong_password_is_told_as_a_sasl_login_the_broker_does_not_complete(secured):
    text = _login_refusal({**secured.conn("generator"), "sasl_plain_password": "not-the-password"})
    assert ("completes TLS (certificate verified), but no Kafka answer came after the SASL login as 'generator' "
            "(SCRAM-SHA-512): a wrong password or user") in text, text
    assert "not-the-password" not in text


def test_a_client_trusting_another_ca_is_told_the_certificate_is_not_trusted(secured, tmp_path):
    other = make_authority(tmp_path, "other-ca", keytool_beside(java_executable()))
    text = _login_refusal({**secured.conn("generator"), "ssl_cafile": str(other.certificate)})
    assert f"{secured.bootstrap} presents a certificate this client does not trust (" in text, text
    assert f"check ROLLOUT_BUS_SSL_CAFILE={str(other.certificate)!r}" in text


def test_a_tls_client_at_a_plaintext_broker_is_told_it_does_not_speak_tls(secured, kafka_bootstrap):
    text = _login_refusal({**secured.conn("generator"), "bootstrap_servers": kafka_bootstrap})
    assert f"{kafka_bootstrap} does not speak TLS (" in text and "check ROLLOUT_BUS_SECURITY_PROTOCOL" in text, text


def test_a_stage_waiting_for_the_cluster_says_why_it_is_not_let_in(secured):
    with pytest.raises(BrokerError) as refused:
        wait_for_cluster({**secured.conn("observer"), "sasl_plain_password": "wrong"}, 3.0, probe_timeout_s=1.0)
    assert "SASL login as 'observer'" in str(refused.value)


# -- actions the ACLs refuse, and the allowed ones beside them ------------------------------------------------


def test_the_generator_may_not_publish_weights_and_nothing_is_written(secured):
    topics = secured.run_topics(generator="generator", trainer="trainer")
    publisher = WeightPublisher(secured.conn("generator"), topics)
    try:
        with pytest.raises(AccessDenied) as refused:
            publisher.publish(1, 1)
    finally:
        publisher.close()
    text = str(refused.value)
    assert text.startswith(f"publishing weights version 1 to {topics.weights} as 'generator' at {secured.bootstrap} "
                           f"was refused: [Error 29] TopicAuthorizationFailedError"), text
    assert text.endswith("check its ACLs, or the --topic-prefix it is allowed")
    assert secured.written(topics.weights) == {topics.weights: 0}

    trainer = WeightPublisher(secured.conn("trainer"), topics)  # the role that may
    try:
        trainer.publish(1, 1)
    finally:
        trainer.close()
    watcher = WeightWatcher(secured.conn("generator"), topics)  # and the generator reads it
    try:
        assert watcher.wait_for(1, timeout_s=30) == 1
    finally:
        watcher.close()


def test_the_generator_may_not_read_shards(secured):
    topics = secured.run_topics(generator="generator")
    reader = TopicReader(secured.conn("generator"), [topics.shards])
    try:
        with pytest.raises(AccessDenied) as refused:
            reader.poll(timeout_ms=2000)
    finally:
        reader.close()
    assert str(refused.value).startswith(f"reading {topics.shards} as 'generator' at {secured.bootstrap} was refused: "
                                         f"[Error 29] TopicAuthorizationFailedError"), refused.value


def test_the_observer_may_produce_nothing_and_the_generate_stage_says_so_in_one_line(secured, tmp_path):
    topics = secured.run_topics(observer="observer")
    done = _cli("generate", "--topic-prefix", topics.prefix, "--episodes", "8", "--seed", "3", "--no-end-of-run",
                env=secured.env("observer"), cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"to topic={topics.turns} as 'observer'" in " ".join(done.stderr.split()), done.stderr
    assert "ClusterAuthorizationFailedError" in done.stderr
    assert done.stderr.count("delivery failed") <= 1  # one line per reason, not one per record
    assert secured.written(topics.turns, topics.dlq) == {topics.turns: 0, topics.dlq: 0}


def test_the_observer_reads_every_topic_of_its_run(secured):
    topics = secured.run_topics(observer="observer", generator="generator")
    producer = new_producer(secured.conn("generator"), acks="all")
    try:
        producer.send(topics.turns, key=b"k", value=b"not a turn: only read back").get(timeout=30)
    finally:
        producer.close()
    reader = TopicReader(secured.conn("observer"), [topics.turns, topics.shards, topics.weights])
    try:
        deadline, got = time.monotonic() + 30, []
        while not got and time.monotonic() < deadline:
            got = reader.poll(timeout_ms=500)[topics.turns]
    finally:
        reader.close()
    assert [r.value for r in got] == [b"not a turn: only read back"]


def test_a_runs_principal_may_not_read_another_runs_prefix(secured):
    run_a = secured.run_topics(trainer="trainer")  # the trainer's ACLs on run A's prefix only
    run_b = secured.run_topics()
    reader = TopicReader(secured.conn("trainer"), [run_a.shards])
    try:
        assert reader.poll(timeout_ms=1000) == {run_a.shards: []}
    finally:
        reader.close()
    began = time.monotonic()
    with pytest.raises(AccessDenied) as refused:  # the cluster hides the topic from it: no wait for it to appear
        TopicReader(secured.conn("trainer"), [run_b.shards])
    assert time.monotonic() - began < 10
    assert str(refused.value).startswith(f"looking up {run_b.shards} as 'trainer' at {secured.bootstrap} was "
                                         f"refused: [Error 29] TopicAuthorizationFailedError"), refused.value
    granted = {b.name for p, b in list_bindings(secured.conn(ADMIN)) if p == "trainer"}
    assert run_a.shards in granted and not any(name.startswith(run_b.prefix) for name in granted)


# -- the ACLs as the broker reports them -------------------------------------------------------------------------


def test_acl_apply_and_kafkas_own_acl_tool_list_the_same_role_table(secured):
    prefix = f"r{uuid.uuid4().hex[:8]}."
    applied = _cli("acl", "apply", "--role", "shards", "--principal", "shards", "--topic-prefix", prefix,
                   env=secured.env(ADMIN))
    assert applied.returncode == 0, applied.stderr
    wanted = role_bindings("shards", "shards", Topics(prefix=prefix))
    assert applied.stdout.splitlines() == [f"User:shards ALLOW {b}" for b in wanted]
    assert set(wanted) <= {b for p, b in list_bindings(secured.conn(ADMIN)) if p == "shards"}

    tool = _cli("kafka", "tool", "acls", "--bootstrap-server", secured.bootstrap, "--command-config",
                str(secured.setup.tools_properties), "--list", "--topic", f"{prefix}rollout.shards")
    assert tool.returncode == 0, tool.stderr
    assert "principal=User:shards, host=*, operation=READ, permissionType=ALLOW" in tool.stdout, tool.stdout
    assert "principal=User:shards, host=*, operation=WRITE, permissionType=ALLOW" in tool.stdout

    refused = _cli("acl", "apply", "--role", "shards", "--principal", "shards", "--topic-prefix", prefix,
                   env=secured.env("observer"))
    assert refused.returncode == 1 and "error:" in refused.stderr and "Traceback" not in refused.stderr


# -- the whole pipeline, each stage as its role ------------------------------------------------------------------


def test_the_pipeline_as_its_roles_gives_the_plaintext_runs_shards_and_leaves_no_password(secured, kafka_bootstrap,
                                                                                           tmp_path):
    secured_run, result = run_pipeline(secured.bootstrap, tmp_path / "secured", conn=secured.conn(ADMIN),
                                       principals=secured.setup.directory, train=True)
    plain_run, _ = run_pipeline(kafka_bootstrap, tmp_path / "plain")
    assert result.ok and shard_digests(secured_run) and shard_digests(secured_run) == shard_digests(plain_run)
    roles = {name: stage.env["ROLLOUT_BUS_SASL_PLAIN_USERNAME"] for name, stage in secured_run.stages.items()}
    assert roles == {"generate": "generator", "stream": "stream", "shards": "shards", "train": "trainer"}

    passwords = [secured.setup.password(u).encode() for u in secured.setup.users()]
    for stage in secured_run.stages.values():  # a stage's command line and environment name the password's file
        assert not [p for p in passwords if p in " ".join([*stage.command, *stage.env.values()]).encode()]
    left = [p for p in (tmp_path / "secured").rglob("*") if p.is_file()]
    assert any(p.suffix == ".log" for p in left) and any(p.name == "manifest.json" for p in left)
    leaked = [str(p) for p in left for secret in passwords if secret in p.read_bytes()]
    assert not leaked, leaked
    assert not [p for p in passwords if p in secured.broker.log_file.read_bytes()]


# -- an outside client from WIRE.md section 2.1 alone --------------------------------------------------------------


def test_librdkafka_with_the_settings_wire_md_gives_produces_as_generator_and_reads_as_observer(secured):
    confluent_kafka = pytest.importorskip("confluent_kafka")
    topics = secured.run_topics(generator="generator", observer="observer")

    def settings(user: str) -> dict:
        return {"bootstrap.servers": secured.bootstrap, "security.protocol": "SASL_SSL",
                "sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": user,
                "sasl.password": secured.setup.password_file(user).read_text().strip(),
                "ssl.ca.location": str(secured.setup.ca_file)}

    producer = confluent_kafka.Producer(settings("generator"))
    failures = []
    producer.produce(topics.turns, key=b"k", value=b"from librdkafka",
                     on_delivery=lambda err, _msg: failures.append(err) if err else None)
    assert producer.flush(30) == 0 and failures == []
    refused = []
    producer.produce(topics.weights, key=b"policy", value=b"{}", on_delivery=lambda err, _msg: refused.append(err))
    producer.flush(30)
    assert [e.code() for e in refused] == [confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED]

    consumer = confluent_kafka.Consumer({**settings("observer"), "group.id": topics.group("rollout-bus-x"),
                                         "enable.auto.commit": False})
    try:
        consumer.assign([confluent_kafka.TopicPartition(topics.turns, p, confluent_kafka.OFFSET_BEGINNING)
                         for p in range(topics.turns_partitions)])
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                got.append(message.value())
    finally:
        consumer.close()
    assert got == [b"from librdkafka"]
    assert secured.written(topics.weights) == {topics.weights: 0}
