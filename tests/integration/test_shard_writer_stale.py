"""The staleness net of the shard writer, against a real broker: ``--max-staleness K`` drops an episode
whose oldest weight version is below ``k - K`` from step batch ``k`` to the DLQ (kind ``stale``), writes
the rest, lists the dropped ones in the manifest, and a batch's metrics carry its staleness.

Episodes are published straight to rollout.episodes, as a generator ignoring the bound would leave
them; the runs end on the end-of-run markers (no clock decides a batch).
"""

from __future__ import annotations

import json
import uuid

import pytest

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.model.metrics import compute_staleness_metrics
from rollout_bus.wire.positions import RangeStart
from rollout_bus.wire.episode_record import EpisodeInfo, decode_episode, encode_episode
from rollout_bus.wire.headers import control_kind
from rollout_bus.replay.rerun import replay
from rollout_bus.wire.rollout_key import rollout_key_string
from tests.integration.test_shard_writer import (ADAPTERS, GROUP_SIZE, end_of_run, make_segment, manifests, publish,
                                                 read_topic, run_writer)

pytestmark = pytest.mark.kafka

G = 2  # the writer's --groups-per-batch in run_writer: batch k holds groups 2k and 2k + 1
K = 1
GROUPS = 10  # batches 0..4
# episodes generated under weights too old for their batch (oldest version < k - K)
STALE = {(4, 1): 0, (6, 0): 1, (7, 2): 0} | {(g, r): 0 for g in (8, 9) for r in range(GROUP_SIZE)}


def version_of(group_index: int, rid: int) -> int:
    """What a generator holding to the bound would use (k - K at worst), unless the episode is in STALE."""
    return STALE.get((group_index, rid), max(0, group_index // G - K))


def make_episode(group_index: int, rid: int):
    """(key, value, headers); every third episode has a compaction sibling, the first segment one version older."""
    adapter = ADAPTERS[group_index % len(ADAPTERS)]
    version = version_of(group_index, rid)
    parts = 2 if rid % 3 == 1 else 1
    segments = []
    for part in range(parts):
        segment = make_segment(adapter, group_index, rid, part)
        own = version if part == 0 or parts == 1 else version + 1
        segment.weight_versions = [str(own), str(own)]  # one entry per engine call
        segments.append(segment)
    info = EpisodeInfo(attempt=0, turns=parts + 1, group_size=GROUP_SIZE, final_sent_at_ms=1, event_time_ms=1)
    key = rollout_key_string((adapter, "rollout", group_index, rid))
    return key.encode(), encode_episode(segments, info), info.headers()


def key_of(group_index: int, rid: int) -> str:
    return make_episode(group_index, rid)[0].decode()


def records(topics):
    return [make_episode(g, r) for g in range(GROUPS) for r in range(GROUP_SIZE)] + end_of_run(topics)


def dead_letters(client_kwargs, topics) -> list[DeadLetter]:
    return [DeadLetter.from_record(r.key, r.value, r.headers) for r in read_topic(client_kwargs, topics.dlq)]


def staleness(metrics: dict, prefix: str = "") -> dict[str, dict[str, float]]:
    """{scope: {stat: value}} of the staleness keys."""
    found: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        path = name[len(prefix):]
        scope, _, stat = path.rpartition("/staleness/") if "/staleness/" in path else ("", "", "")
        if not stat and path.startswith("staleness/"):
            scope, stat = "", path[len("staleness/"):]
        if stat:
            found.setdefault(scope, {})[stat] = value
    return found


def test_stale_episodes_go_to_the_dlq_the_rest_is_written_and_manifests_list_them(kafka_bootstrap, client_kwargs,
                                                                                   topics, tmp_path):
    publish(client_kwargs, topics.episodes, records(topics))
    out = tmp_path / "out"
    done = run_writer(kafka_bootstrap, topics, out, None, "--max-staleness", str(K))
    assert "9 stale" in done.stderr + done.stdout

    dead = dead_letters(client_kwargs, topics)
    assert {d.kind for d in dead} == {"stale"} and {d.stage for d in dead} == {"shards"}
    assert sorted(d.key.decode() for d in dead) == sorted(key_of(g, r) for g, r in STALE)
    published = {k: v for k, v, _ in records(topics)[:GROUPS * GROUP_SIZE]}
    for d in dead:
        assert d.value == published[d.key]  # the original record, byte for byte
        assert d.source.startswith(f"{topics.episodes}:")
    [letter] = [d for d in dead if d.key.decode() == key_of(6, 0)]
    for part in (key_of(6, 0), "oldest weight version 1", "batch 3", f"max_staleness={K}", ">= 2"):
        assert part in letter.reason, letter.reason

    written = manifests(out)
    assert [m["seq"] for m in written] == [0, 1, 2, 3]  # batch 4 was all stale: skipped
    by_seq = {m["seq"]: m for m in written}
    for seq, manifest in by_seq.items():
        extra = manifest["extra"]
        stale_keys = {e["key"] for e in extra["stale"]}
        assert stale_keys == {key_of(g, r) for g, r in STALE if g // G == seq}
        assert extra["max_staleness"] == K
        assert not stale_keys & {e["key"] for e in extra["episodes"]}
        assert len(extra["episodes"]) + len(stale_keys) == G * GROUP_SIZE
        assert all(int(v) >= seq - K for v in extra["weight_versions"])
        # every batch's metrics carry its staleness, per adapter; after the net, nothing is older than K
        scoped = staleness(manifest["metrics"])
        assert scoped and all(scope.startswith("adapter/") for scope in scoped)
        assert all(stats["oldest"] <= K and stats["max"] <= K for stats in scoped.values()), scoped
    assert [(e["key"], e["oldest_version"]) for e in by_seq[2]["extra"]["stale"]] == [(key_of(4, 1), 0)]
    assert by_seq[2]["extra"]["stale"][0]["segments"] == 2

    shards = read_topic(client_kwargs, topics.shards)
    controls = [(control_kind(r.headers), json.loads(r.value)) for r in shards if control_kind(r.headers)]
    assert [(kind, doc.get("seq"), doc.get("why")) for kind, doc in controls] == [
        ("batch-skipped", 4, "empty"), ("end-of-run", None, None)]
    metrics = [json.loads(r.value) for r in read_topic(client_kwargs, topics.metrics)]
    batch_docs = {doc["batch"]: doc for doc in metrics if doc["kind"] == "batch"}
    assert sorted(batch_docs) == [0, 1, 2, 3]
    for seq, doc in batch_docs.items():
        assert staleness(doc["metrics"], "rollout/") == staleness(by_seq[seq]["metrics"])

    # a second writer reading the whole log again into the same output decides the same: the stale
    # episodes of batches on disk are already decided there (duplicates, no new dead letter), and
    # batch 4 is formed again and dropped again
    # a replay of the log applies the same net (K from the manifests): the same batches, byte for byte
    report = replay(client_kwargs, [RangeStart(topics.episodes)], out_dir=tmp_path / "replayed", compare_dir=out)
    assert {b.seq: b.status for b in report.batches} == {seq: "identical" for seq in (0, 1, 2, 3)}

    run_writer(kafka_bootstrap, topics, out, None, "--max-staleness", str(K))
    again = dead_letters(client_kwargs, topics)[len(dead):]
    assert sorted(d.key.decode() for d in again) == sorted(key_of(g, r) for g, r in STALE if g // G == 4)
    assert [m["seq"] for m in manifests(out)] == [0, 1, 2, 3]


def test_without_max_staleness_nothing_is_dead_lettered_and_the_metrics_show_how_stale_it_was(
        kafka_bootstrap, client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics.episodes, records(topics))
    run_writer(kafka_bootstrap, topics, tmp_path)

    assert dead_letters(client_kwargs, topics) == []
    written = {m["seq"]: m for m in manifests(tmp_path)}
    assert sorted(written) == [0, 1, 2, 3, 4]
    assert all(m["extra"]["stale"] == [] and m["extra"]["max_staleness"] is None for m in written.values())
    # batch 4 (groups 8: code, 9: adapter-less) was generated under version 0 (siblings' later segments
    # under 1): its metrics are those of its samples at step 4, token-weighted
    samples = [s for g in (8, 9) for r in range(GROUP_SIZE) for s in decode_episode(make_episode(g, r)[1])[0]]
    expected = compute_staleness_metrics(samples, 4)
    assert {k: v for k, v in written[4]["metrics"].items() if "staleness/" in k} == pytest.approx(expected)
    assert staleness(expected) == {"adapter/code": {"mean": pytest.approx(3.6875), "max": 4.0, "oldest": 4.0}}
    assert staleness(written[3]["metrics"])["adapter/math"]["oldest"] == 3.0  # (7, 2): version 0 in batch 3


def test_arrival_batching_has_no_net(kafka_bootstrap, client_kwargs, topics, tmp_path):
    publish(client_kwargs, topics.episodes, records(topics))
    done = run_writer(kafka_bootstrap, topics, tmp_path, uuid.uuid4().hex, "--batching", "arrival",
                      "--max-staleness", str(K))
    assert "ignored" in done.stderr
    assert dead_letters(client_kwargs, topics) == []
    assert sum(len(m["extra"]["episodes"]) for m in manifests(tmp_path)) == GROUPS * GROUP_SIZE
