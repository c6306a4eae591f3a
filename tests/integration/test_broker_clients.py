"""Both Kafka clients the project uses round-trip a record with headers through the real broker."""

from __future__ import annotations

import asyncio
import uuid

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic


def _fresh_topic(client_kwargs) -> str:
    name = f"it-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(**client_kwargs)
    admin.create_topics([NewTopic(name, 1, 1)])
    admin.close()
    return name


def test_kafka_python_round_trips_key_value_and_headers(client_kwargs):
    topic = _fresh_topic(client_kwargs)
    producer = KafkaProducer(acks="all", **client_kwargs)
    meta = producer.send(topic, key=b"k1", value=b"v1", headers=[("turn", b"0"), ("final", b"1")]).get(timeout=30)
    producer.close()

    consumer = KafkaConsumer(**client_kwargs, enable_auto_commit=False)
    tp = TopicPartition(topic, meta.partition)
    consumer.assign([tp])
    consumer.seek(tp, meta.offset)
    records = []
    for _ in range(30):
        records += [r for batch in consumer.poll(timeout_ms=1000).values() for r in batch]
        if records:
            break
    consumer.close()
    assert [(r.key, r.value, r.headers) for r in records] == [(b"k1", b"v1", [("turn", b"0"), ("final", b"1")])]


def test_aiokafka_round_trips_key_value_and_headers(client_kwargs):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = _fresh_topic(client_kwargs)

    async def scenario():
        producer = AIOKafkaProducer(bootstrap_servers=client_kwargs["bootstrap_servers"], acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, key=b"k2", value=b"v2", headers=[("attempt", b"3")])
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=client_kwargs["bootstrap_servers"],
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            record = await asyncio.wait_for(consumer.getone(), timeout=30)
        finally:
            await consumer.stop()
        return record

    record = asyncio.run(scenario())
    assert (record.key, record.value, list(record.headers)) == (b"k2", b"v2", [("attempt", b"3")])
