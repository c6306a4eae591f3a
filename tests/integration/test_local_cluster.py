"""The three-node local cluster: one cluster id, static voters, RF 3 / min ISR 2, and no loss when a leader dies.

The cluster runs on ports and a data directory of its own (the suite's broker is untouched).
"""

from __future__ import annotations

import time

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from rollout_bus.errors import AccessDenied, ConfigError
from rollout_bus.consumers.feed.weights import WeightPublisher
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.clients import new_producer
from rollout_bus.local_kafka.local_broker import port_is_free
from rollout_bus.local_kafka.local_cluster import LocalCluster, cluster_properties, free_ports
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.wire.topics import Topics

TOPIC = "cluster-drill"
RECORDS_PER_PHASE = 300


def test_node_configuration_names_every_voter_and_the_replication_defaults(tmp_path):
    voters = "1@127.0.0.1:40001,2@127.0.0.1:40003,3@127.0.0.1:40005"
    props = dict(line.split("=", 1) for line in cluster_properties(2, 40002, tmp_path, voters).splitlines())
    assert props["node.id"] == "2" and props["controller.quorum.voters"] == voters
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:40002,CONTROLLER://127.0.0.1:40003"
    assert props["default.replication.factor"] == props["offsets.topic.replication.factor"] == "3"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"


def test_ports_must_be_three_without_overlap(tmp_path):
    with pytest.raises(ConfigError, match="ports"):
        LocalCluster([40010, 40011, 40020], tmp_path)  # 40010's controller takes 40011
    with pytest.raises(ConfigError, match="ports"):
        LocalCluster([40010, 40020], tmp_path)


def test_base_port_places_the_nodes_two_ports_apart(tmp_path):
    cluster = LocalCluster(base_port=40100, data_dir=tmp_path)
    assert cluster.ports == (40100, 40102, 40104) and cluster.node(3).controller_port == 40105
    assert cluster.node(1).voters == "1@127.0.0.1:40101,2@127.0.0.1:40103,3@127.0.0.1:40105"
    assert cluster.bootstrap == "127.0.0.1:40100,127.0.0.1:40102,127.0.0.1:40104"
    with pytest.raises(ConfigError, match="ports or base_port"):
        LocalCluster([40010, 40020, 40030], tmp_path, base_port=40100)
    with pytest.raises(ConfigError, match="ports or base_port"):
        LocalCluster(data_dir=tmp_path)


def _produce(producer: KafkaProducer, start: int, count: int) -> None:
    futures = [producer.send(TOPIC, key=b"k%d" % (i % 7), value=b"%d" % i) for i in range(start, start + count)]
    producer.flush(timeout=120)
    for future in futures:
        future.get(timeout=1)  # raises if any record was not acknowledged by min.insync.replicas


def _consume_all(bootstrap: str, expected: int, timeout_s: float = 60.0) -> list[int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(TOPIC, p) for p in sorted(consumer.partitions_for_topic(TOPIC) or [])]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        values: list[int] = []
        deadline = time.monotonic() + timeout_s
        while len(values) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                values += [int(r.value) for r in batch]
        return values
    finally:
        consumer.close()


def test_a_killed_leader_loses_no_acknowledged_record_and_rejoins_after_restart(tmp_path):
    ports = free_ports(3)
    cluster = LocalCluster(ports, tmp_path / "cluster", echo=lambda _msg: None)
    cluster.start()
    try:
        ids = {(node.data_dir / "data" / "meta.properties").read_text().split("cluster.id=")[1].split()[0]
               for node in cluster.nodes.values()}
        assert len(ids) == 1, f"the nodes were formatted with different cluster ids: {ids}"
        admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap)
        admin.create_topics([NewTopic(TOPIC, 2, 3)])
        admin.close()
        producer = KafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all", enable_idempotence=True,
                                 linger_ms=5, retry_backoff_ms=200)
        _produce(producer, 0, RECORDS_PER_PHASE)

        leader = cluster.leader(TOPIC, 0)
        assert leader in cluster.nodes
        cluster.kill(leader)
        _produce(producer, RECORDS_PER_PHASE, RECORDS_PER_PHASE)  # acks=all still met by the two left
        producer.close()
        deadline = time.monotonic() + 60
        while cluster.leader(TOPIC, 0) in (None, leader) and time.monotonic() < deadline:
            time.sleep(0.2)  # the dead node is fenced after broker.session.timeout.ms
        assert cluster.leader(TOPIC, 0) not in (None, leader)

        values = _consume_all(cluster.live_bootstrap(), 2 * RECORDS_PER_PHASE)
        assert sorted(values) == list(range(2 * RECORDS_PER_PHASE)), "lost or duplicated records"
        assert (TOPIC, 0) in cluster.under_replicated([TOPIC])

        cluster.start_node(leader)
        cluster.wait_fully_replicated(topics=[TOPIC])
        assert cluster.under_replicated([TOPIC]) == []
    finally:
        cluster.stop()
    assert all(port_is_free(p) and port_is_free(p + 1) for p in ports)


def test_a_secured_cluster_replicates_over_tls_keeps_its_acls_and_serves_through_a_killed_node(tmp_path):
    cluster = LocalCluster(free_ports(3), tmp_path / "cluster", echo=lambda _msg: None, secure=True)
    cluster.start()
    try:
        setup = cluster.secure
        log = "".join(n.log_file.read_text(errors="replace") for n in cluster.nodes.values())
        assert "SASL_SSL" in log and not [u for u in setup.users() if setup.password(u) in log]
        topics = Topics()  # the roles' ACLs are on the unprefixed topics
        ensure_topics(cluster.connection(), topics, replication_factor=3)
        generator = setup.client_kwargs("generator", cluster.bootstrap)
        producer = new_producer(generator, acks="all", retry_backoff_ms=200)
        for i in range(RECORDS_PER_PHASE):
            producer.send(topics.turns, key=b"k", value=str(i).encode())
        producer.flush(timeout=60)
        leader = cluster.leader(topics.turns, 0)
        cluster.kill(leader)  # replicated over the secured inter-broker listener: nothing is lost
        reader = TopicReader(setup.client_kwargs("observer", cluster.live_bootstrap()), [topics.turns])
        try:
            values: list[int] = []
            deadline = time.monotonic() + 90
            while len(values) < RECORDS_PER_PHASE and time.monotonic() < deadline:
                values += [int(r.value) for r in reader.poll(timeout_ms=500)[topics.turns]]
        finally:
            reader.close()
        assert sorted(values) == list(range(RECORDS_PER_PHASE))
        producer.close()
        weights = WeightPublisher({**generator, "bootstrap_servers": cluster.live_bootstrap()}, topics)
        try:
            with pytest.raises(AccessDenied):
                weights.publish(1, 1)
        finally:
            weights.close()
    finally:
        cluster.stop()
