"""One real Kafka broker for the whole integration suite.

``make test`` starts the project's local broker and passes it in ``ROLLOUT_BUS_TEST_BOOTSTRAP_SERVERS``;
run alone (plain ``pytest``), the fixture starts one itself on port 39092 and stops it at the end.
Every test gets its own topic prefix, so tests never see each other's records.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.local_kafka.local_broker import LocalBroker, broker_answers
from rollout_bus.wire.topics import Topics

TEST_PORT = 39092


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    given = os.environ.get("ROLLOUT_BUS_TEST_BOOTSTRAP_SERVERS")
    if not given and broker_answers(f"127.0.0.1:{TEST_PORT}"):
        given = f"127.0.0.1:{TEST_PORT}"  # a suite broker left up by `make test-broker`
    if given:
        yield given
        return
    broker = LocalBroker(port=TEST_PORT, data_dir=Path(tmp_path_factory.mktemp("kafka")))
    status = broker.start()
    yield status.bootstrap
    broker.stop()


@pytest.fixture
def client_kwargs(kafka_bootstrap) -> dict:
    return {"bootstrap_servers": kafka_bootstrap}


@pytest.fixture
def topics(client_kwargs) -> Topics:
    """Fresh, created pipeline topics under a prefix unique to this test."""
    prefixed = Topics(prefix=f"t{uuid.uuid4().hex[:10]}.")
    ensure_topics(client_kwargs, prefixed)
    return prefixed
