"""Topic administration with kafka-python: create the pipeline's topics idempotently."""

from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from rollout_bus.topics import Topics

logger = logging.getLogger(__name__)


def ensure_topics(client_kwargs: dict[str, Any], topics: Topics, *, replication_factor: int = 1,
                  extra: dict[str, int] | None = None) -> list[str]:
    """Create every pipeline topic that does not exist yet; return the names created.

    ``extra`` maps further topic names to partition counts (tests use it for private topics).
    """
    wanted = {spec.name: spec.partitions for spec in topics.specs()}
    wanted.update(extra or {})
    admin = KafkaAdminClient(client_id="rollout-bus-admin", **client_kwargs)
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(name, partitions, replication_factor) for name, partitions in wanted.items()
                   if name not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:  # another process won the race: fine
                pass
        for topic in missing:
            logger.info("created topic=%s partitions=%d", topic.name, topic.num_partitions)
        return [t.name for t in missing]
    finally:
        admin.close()

