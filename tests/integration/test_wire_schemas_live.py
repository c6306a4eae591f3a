"""WIRE.md's schemas against a real run: the three stage processes on the real broker, then every record they
left on rollout.metrics, rollout.shards and rollout.dlq, a few of rollout.turns and rollout.episodes, and every
manifest on disk must match its schema. The run injects the generator's faults, so dead letters and a skipped
batch are on the topics too. Also: the turn WIRE.md section 13 produces with confluent-kafka lands on its key's
murmur2 partition and decodes as the stream worker decodes it.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.errors import CodecError
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.wire.partitioning import partition_for
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.shard_announcement import parse_announcement
from rollout_bus.wire.headers import TurnHeaders, control_kind
from tests.integration.pipeline_harness import run_pipeline
from tests.unit.wire.test_wire_schemas import samples_meta, wire_example
from tests.wire_schemas import header_object, validate

pytestmark = pytest.mark.kafka

FEW_TURNS = 12


@pytest.fixture(scope="module")
def live(kafka_bootstrap, tmp_path_factory):
    """One faulty run with two adapters, and every record of its topics read back."""
    run, _ = run_pipeline(kafka_bootstrap, tmp_path_factory.mktemp("wire-live"), adapters="math,code",
                          inject_faults=True, seed=13)
    t = run.topics
    reader = TopicReader(run.kwargs, [t.turns, t.episodes, t.metrics, t.shards, t.dlq])
    try:
        records = reader.read_to_end(timeout_s=60)
    finally:
        reader.close()
    return run, records


def _data(records):
    return [r for r in records if control_kind(r.headers) is None]


def test_every_metrics_record_matches_its_schema(live):
    run, records = live
    docs = [json.loads(r.value) for r in records[run.topics.metrics]]
    kinds = {doc["kind"] for doc in docs}
    assert kinds == {"window", "batch", "flow"}, kinds  # flow: the generator's own (rollout.metrics 6.3)
    for doc in docs:
        validate(f"{doc['kind']}_metrics", doc)
        if doc["kind"] == "window":
            validate("episode_stats", json.loads(doc["stats"]))


def test_every_shards_record_matches_its_schema_and_names_its_manifest(live):
    run, records = live
    by_kind = {}
    for record in records[run.topics.shards]:
        kind = control_kind(record.headers)
        by_kind.setdefault(kind, []).append(json.loads(record.value))
        if kind is None:
            doc = json.loads(record.value)
            validate("shard_announcement", doc)
            announced = parse_announcement(record.value)
            manifest = announced.batch_dir() / "manifest.json"  # dir under out_root (or an absolute dir)
            assert hashlib.sha256(manifest.read_bytes()).hexdigest() == doc["manifest_sha256"]
            mine = announced.batch_dir(run.out / "shards")  # a reader's own root
            assert mine.resolve() == manifest.parent.resolve() and mine.name == doc["batch"]
        else:
            validate({"batch-skipped": "batch_skipped", "end-of-run": "batches_ended"}[kind], json.loads(record.value))
    assert by_kind.get(None) and by_kind.get("end-of-run"), sorted(map(str, by_kind))
    assert by_kind.get("batch-skipped"), "the injected replay gap should have a batch dead-lettered and skipped"


def test_every_manifest_on_disk_matches_its_schema(live):
    run, _ = live
    manifests = sorted((run.out / "shards").glob("batch-*/manifest.json"))
    assert manifests
    for path in manifests:
        validate("manifest", json.loads(path.read_text()))


def test_every_dead_letter_carries_headers_that_match_the_schema(live):
    run, records = live
    letters = records[run.topics.dlq]
    assert letters, "the run injected faults: something must be dead-lettered"
    stages = set()
    for record in letters:
        headers = header_object(record.headers)
        validate("dlq_headers", headers)
        stages.add(DeadLetter.from_record(record.key, record.value, record.headers).stage)
    assert stages == {"stream", "shards"}


def test_a_few_turns_and_episodes_match_their_schemas(live):
    run, records = live
    decoded = 0
    for record in _data(records[run.topics.turns]):
        validate("rollout_key", record.key.decode("ascii"))
        validate("turn_headers", header_object(record.headers))
        try:
            decode_samples(record.value, TURN_FIELDS)
        except CodecError:
            continue  # the injected malformed record
        validate("samples_meta", samples_meta(record.value))
        decoded += 1
        if decoded == FEW_TURNS:
            break
    assert decoded == FEW_TURNS
    for record in records[run.topics.turns]:
        if control_kind(record.headers) == "end-of-run":
            validate("end_of_run", json.loads(record.value))
    for record in records[run.topics.episodes][:FEW_TURNS]:
        kind = control_kind(record.headers)
        if kind is None:
            meta = samples_meta(record.value)
            validate("samples_meta", meta)
            validate("episode_meta", meta["metadata"])
            validate("episode_headers", header_object(record.headers))
        else:
            validate({"abandoned": "abandoned", "end-of-run": "end_of_run"}[kind], json.loads(record.value))


def test_the_wire_md_confluent_kafka_example_lands_on_its_keys_murmur2_partition(kafka_bootstrap, client_kwargs,
                                                                                 topics):
    pytest.importorskip("confluent_kafka")
    wire_example()["send_turn"](kafka_bootstrap, topics.turns)
    reader = TopicReader(client_kwargs, [topics.turns])
    try:
        (record,) = reader.read_to_end(timeout_s=30)[topics.turns]
    finally:
        reader.close()
    assert record.key == b'[null,null,"rollout",0,0]'
    assert record.partition == partition_for(record.key, topics.turns_partitions)
    headers = TurnHeaders.from_kafka(record.headers)
    assert (headers.turn, headers.attempt, headers.final, headers.group_size) == (0, 0, True, 1)
    (sample,), _ = decode_samples(record.value, TURN_FIELDS)
    assert sample.response_length == 3 and sample.rollout_sampling_mask.row(0).tolist() == [7, 40]
    validate("turn_headers", header_object(record.headers))
