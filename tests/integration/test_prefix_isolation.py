"""Two runs with different topic prefixes on one broker at the same time do not see each other.

Both runs give their stages the same names (``rollout-bus-stream``, ``rollout-bus-shards``); the
prefix scopes the consumer groups and the stream's changelog as it scopes the topics. Run B runs
whole while run A's stages are up; each must account for exactly its own episodes.
"""

from __future__ import annotations

from kafka import KafkaAdminClient

from rollout_bus.demo.run import STREAM_APP_ID
from tests.integration.pipeline_harness import run_pipeline


def _group_topics(admin: KafkaAdminClient, group: str) -> set[str]:
    return {tp.topic for tp in admin.list_group_offsets({group: None}).get(group, {})}


def test_two_runs_with_different_prefixes_share_a_broker_without_sharing_groups_or_state(kafka_bootstrap, tmp_path):
    inner = []

    def run_b_meanwhile(run_a, watcher) -> None:
        inner.append(run_pipeline(kafka_bootstrap, tmp_path / "b", seed=8, episodes=16))

    run_a, result_a = run_pipeline(kafka_bootstrap, tmp_path / "a", seed=7, episodes=24, drill=run_b_meanwhile)
    (run_b, result_b), = inner
    assert run_a.topics.prefix != run_b.topics.prefix
    assert run_a.stream_group == f"{run_a.topics.prefix}{STREAM_APP_ID}" != run_b.stream_group
    # each run's reconciliation: every episode it sent in exactly one of its shards, nothing else there
    assert result_a.ok and result_b.ok
    assert sum(1 for _ in (tmp_path / "a" / "shards").glob("batch-*/manifest.json")) > 0
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        topics = set(admin.list_topics())
        for run in (run_a, run_b):
            assert f"{run.stream_group}-state-changelog" in topics
            assert _group_topics(admin, run.stream_group) == {run.topics.turns}
            assert _group_topics(admin, run.shards_group) == {run.topics.episodes}
    finally:
        admin.close()
