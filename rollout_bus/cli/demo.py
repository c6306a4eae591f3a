"""``rollout-bus demo``: the main job, end to end, on the local broker unless one is given."""

from __future__ import annotations

import time

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.config import KafkaSettings
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.local_broker import BrokerLease

console = Console(stderr=True)


def demo(bootstrap_servers: str | None = options.BOOTSTRAP, topic_prefix: str | None = options.TOPIC_PREFIX,
         port: int = options.PORT) -> None:
    """Start the local broker if needed, create the topics, send and read back records, stop."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    echo = lambda m: console.print(f"[dim]{m}[/dim]")  # noqa: E731
    settings = KafkaSettings(bootstrap_servers=bootstrap_servers or "", topic_prefix=topic_prefix or "",
                             local_port=port)
    with BrokerLease(settings.bootstrap_servers or None, port=port, echo=echo) as bootstrap:
        kwargs = {**settings.client_kwargs(), "bootstrap_servers": bootstrap}
        topics = settings.topics()
        created = ensure_topics(kwargs, topics)
        console.print(f"topics: {', '.join(topics.names())} ({len(created)} created)")
        producer = KafkaProducer(acks="all", **kwargs)
        sent = [producer.send(topics.metrics, key=f"demo-{i}".encode(), value=f'{{"n":{i}}}'.encode(),
                              headers=[("schema", b"1")]).get(timeout=30) for i in range(3)]
        producer.close()
        console.print(f"sent {len(sent)} records to {topics.metrics} at offsets {[m.offset for m in sent]}")
        consumer = KafkaConsumer(**kwargs, enable_auto_commit=False, consumer_timeout_ms=5000)
        tp = TopicPartition(topics.metrics, sent[0].partition)
        consumer.assign([tp])
        consumer.seek(tp, sent[0].offset)
        got = []
        deadline = time.monotonic() + 30
        while len(got) < len(sent) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=1000).values():
                got.extend(records)
        consumer.close()
        for record in got[: len(sent)]:
            console.print(f"  read {record.key.decode()} = {record.value.decode()} headers={record.headers}")
        if len(got) < len(sent):
            console.print(f"[red]read back only {len(got)} of {len(sent)} records[/red]")
            raise typer.Exit(1)
        console.print("[green]demo ok[/green]")
