"""ensure_topics on a cluster whose listing lags (another process made a topic, or a broker just started):
a topic the listing missed is an existing one (its limit raised, not said created), and created topics are
returned once listed."""

from __future__ import annotations

from kafka.errors import TopicAlreadyExistsError

from rollout_bus.kafka import admin as admin_module
from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.wire.topics import Topics

TOPICS = Topics(prefix="run.")
SMALL = "1048588"


class LaggingCluster:
    """``turns`` exists (small limit) but is not listed at first; created topics show up after a few listings."""

    def __init__(self):
        self.topics = {TOPICS.turns: SMALL}
        self.listed_after = {}  # name -> listings before it shows
        self.listings = 0
        self.altered = []

    def list_topics(self):
        self.listings += 1
        return [n for n in self.topics if n != TOPICS.turns and self.listed_after.get(n, 0) < self.listings]

    def create_topics(self, specs):
        (name, spec), = specs.items()
        if name in self.topics:
            raise TopicAlreadyExistsError(name)
        self.topics[name] = spec["configs"]["max.message.bytes"]
        self.listed_after[name] = self.listings + 2

    def describe_configs(self, resources, config_filter="all"):
        return {"topic": {r.name: {"max.message.bytes": {"value": self.topics[r.name]}} for r in resources}}

    def alter_configs(self, resources):
        (r,) = resources
        self.topics[r.name] = r.configs["max.message.bytes"]
        self.altered.append(r.name)
        return {"topic": {r.name: "OK"}}

    def close(self):
        pass


def test_a_topic_the_listing_missed_is_raised_not_created_and_created_ones_are_listed_before_return(monkeypatch):
    cluster = LaggingCluster()
    monkeypatch.setattr(admin_module, "new_admin", lambda conn: cluster)
    created = ensure_topics({"bootstrap_servers": "x"}, TOPICS)
    assert TOPICS.turns not in created and sorted(created) == sorted(n for n in TOPICS.names() if n != TOPICS.turns)
    assert cluster.altered == [TOPICS.turns] and int(cluster.topics[TOPICS.turns]) > int(SMALL)
    assert set(created) <= set(cluster.list_topics())  # listed by the time ensure_topics returned
