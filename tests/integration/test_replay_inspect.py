"""Replay rebuilds the shards a run wrote, byte for byte; inspect shows one record to a person.

One pipeline run with the deliberate faults (a batch refused by the mask check, a turn for a
finished episode, a malformed turn) serves every test, so the DLQ holds real dead letters.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from rollout_bus.cli.inspect import inspect as inspect_command
from rollout_bus.cli.replay import replay as replay_command
from rollout_bus.errors import CodecError, ConfigError
from rollout_bus.observe.inspect import inspect_position, render
from rollout_bus.kafka.clients import wait_for_partitions
from rollout_bus.kafka.reader import TopicReader, open_reader
from rollout_bus.wire.positions import Position, RangeStart
from rollout_bus.wire.headers import control_kind
from rollout_bus.replay.rerun import replay
from rollout_bus.replay.settings import manifests_in_dir, settle_settings
from tests.integration.pipeline_harness import run_pipeline


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay-run")
    run, _ = run_pipeline(kafka_bootstrap, out, seed=11, episodes=32, inject_faults=True)
    return run


@pytest.fixture(scope="module")
def dead_letters(kafka_bootstrap, pipeline) -> list[dict]:
    """Every record on the run's DLQ, described."""
    consumer = open_reader({"bootstrap_servers": kafka_bootstrap})
    try:
        parts = wait_for_partitions(consumer, pipeline.topics.dlq)
        from kafka import TopicPartition
        ends = consumer.end_offsets([TopicPartition(pipeline.topics.dlq, p) for p in parts])
    finally:
        consumer.close()
    return [inspect_position({"bootstrap_servers": kafka_bootstrap}, Position(tp.topic, tp.partition, o))
            for tp, end in ends.items() for o in range(end)]


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("batch-*/dp-*.safetensors"))}


def app_of(command) -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(command)
    return app


# ---------------------------------------------------------------------------- replay


def test_replaying_every_episode_partition_rebuilds_every_shard_byte_for_byte(kafka_bootstrap, pipeline, tmp_path):
    original = digests(pipeline.out / "shards")
    assert len(original) >= 4  # at least two batches of two ranks
    report = replay({"bootstrap_servers": kafka_bootstrap}, [RangeStart(pipeline.topics.episodes)],
                    out_dir=tmp_path / "rebuilt")
    assert digests(tmp_path / "rebuilt") == original
    statuses = {b.seq: b.status for b in report.batches}
    written = {int(name.split("/")[0].removeprefix("batch-")) for name in original}
    assert {seq for seq, status in statuses.items() if status == "identical"} == written
    assert statuses[0] == "dead-lettered"  # the injected replay gap fails the whole-batch mask check
    assert report.manifests_from == pipeline.topics.shards
    assert report.settings.sources["dp_size"].startswith("manifest")
    assert report.settings.sources["groups_per_batch"].startswith("inferred")
    assert (report.settings.dp_size, report.settings.groups_per_batch) == (2, 2)


def test_replaying_turns_re_merges_the_episodes_and_rebuilds_the_same_shards(kafka_bootstrap, pipeline, tmp_path):
    out = tmp_path / "from-turns"
    result = CliRunner().invoke(app_of(replay_command), [
        "--from", pipeline.topics.turns, "--out", str(out), "--compare", str(pipeline.out / "shards"),
        "--bootstrap-servers", kafka_bootstrap, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert digests(out) == digests(pipeline.out / "shards")
    assert report["kind"] == "turns" and report["open_episodes"] == 0
    assert {(r["stage"], r["kind"]) for r in report["rejections"]} >= {("stream", "finished"), ("stream", "decode")}


def _wholly_inside(manifests: dict[int, dict], to: int) -> set[int]:
    return {seq for seq, m in manifests.items() if all(e["offset"] < to for e in m["extra"]["episodes"])}


def test_a_partial_range_rebuilds_only_the_batches_wholly_inside_it(kafka_bootstrap, pipeline, tmp_path):
    manifests = manifests_in_dir(pipeline.out / "shards")
    cut = next((to for to in range(1, 64) if _wholly_inside(manifests, to)
                and len(_wholly_inside(manifests, to)) < len(manifests)), None)
    assert cut is not None, "the run's batches should not all end at the same offset"
    inside = _wholly_inside(manifests, cut)
    out = tmp_path / "partial"
    report = replay({"bootstrap_servers": kafka_bootstrap}, [RangeStart(pipeline.topics.episodes)], to=cut,
                    out_dir=out, compare_dir=pipeline.out / "shards")
    original = digests(pipeline.out / "shards")
    rebuilt = digests(out)
    assert {int(n.split("/")[0].removeprefix("batch-")) for n in rebuilt} - {0} == inside
    assert all(rebuilt[name] == original[name] for name in rebuilt)
    by_seq = {b.seq: b for b in report.batches}
    for seq in manifests:
        expected = "identical" if seq in inside else {"incomplete", "not-in-range"}
        assert by_seq[seq].status in (expected if isinstance(expected, set) else {expected}), by_seq[seq]
    assert not report.differs


def test_a_setting_that_disagrees_with_the_manifests_is_warned_about(pipeline):
    manifests = manifests_in_dir(pipeline.out / "shards")
    settled = settle_settings({"dp_size": 3}, manifests)
    assert settled.dp_size == 3 and settled.sources["dp_size"] == "flag"
    assert any("--dp-size 3 differs from 2" in w for w in settled.warnings)
    assert settle_settings({}, {}).sources == {n: "default" for n in
                                              ("batching", "dp_size", "groups_per_batch", "normalization")}


def test_replay_refuses_an_output_directory_that_already_holds_batches(kafka_bootstrap, pipeline):
    with pytest.raises(ConfigError, match="--out"):
        replay({"bootstrap_servers": kafka_bootstrap}, [RangeStart(pipeline.topics.episodes)],
               out_dir=pipeline.out / "shards")


def test_replay_refuses_ranges_of_a_topic_it_cannot_rebuild_from(kafka_bootstrap, pipeline, tmp_path):
    with pytest.raises(ConfigError, match="rollout.episodes or rollout.turns"):
        replay({"bootstrap_servers": kafka_bootstrap}, [RangeStart(pipeline.topics.dlq)], out_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match="offset"):
        replay({"bootstrap_servers": kafka_bootstrap}, [RangeStart(pipeline.topics.episodes, 0, 10**9)],
               out_dir=tmp_path / "y")


# ---------------------------------------------------------------------------- inspect


def _rendered(description: dict) -> str:
    buffer = io.StringIO()
    render(description, Console(file=buffer, width=160, emoji=False))
    return buffer.getvalue()


def test_inspecting_a_turn_shows_its_identity_tokens_loss_mask_and_supports(kafka_bootstrap, pipeline):
    d = inspect_position({"bootstrap_servers": kafka_bootstrap}, f"{pipeline.topics.turns}:0:0")
    assert d["kind"] == "turns" and d["turn_headers"]["turn"] >= 0
    sample = d["samples"][0]
    assert set(sample["identity"]) >= {"adapter", "group_index", "index", "rollout_id", "attempt", "turn"}
    assert d["key"].startswith("[") and str(sample["identity"]["group_index"]) in d["key"]
    n = sample["response_length"]
    assert len(sample["sampling_mask"]["offsets"]) == n + 1 and len(sample["loss_mask"]) == n
    text = _rendered(d)
    for fragment in ("identity", f"group_index={sample['identity']['group_index']}", "loss mask", "support",
                     "header turn", d["key"]):
        assert fragment in text


def test_inspecting_an_episode_shows_every_segment(kafka_bootstrap, pipeline):
    manifests = manifests_in_dir(pipeline.out / "shards")
    entry = max((e for m in manifests.values() for e in m["extra"]["episodes"]), key=lambda e: e["segments"])
    d = inspect_position({"bootstrap_servers": kafka_bootstrap},
                         Position(pipeline.topics.episodes, entry["partition"], entry["offset"]))
    assert d["key"] == entry["key"] and d["episode"]["attempt"] == entry["attempt"]
    assert len(d["samples"]) == entry["segments"]
    assert f"episodes sample {entry['segments']}/{entry['segments']}" in _rendered(d)


def test_inspecting_dead_letters_shows_the_reason_and_decodes_the_original_when_it_decodes(dead_letters):
    by_kind = {d["dlq"]["kind"]: d for d in dead_letters}
    assert {"mask-check", "finished", "decode"} <= set(by_kind)
    assert by_kind["mask-check"]["original"]["decoded_as"] == "episodes"
    assert "sampling-mask data must be present" in by_kind["mask-check"]["dlq"]["reason"]
    assert by_kind["finished"]["original"]["decoded_as"] == "turns"
    assert "decode_error" in by_kind["decode"]["original"]
    text = _rendered(by_kind["decode"])
    assert "dead letter" in text and "dlq.source" in text and "does not decode" in text


def test_inspect_prints_json_for_programs(kafka_bootstrap, pipeline):
    reader = TopicReader({"bootstrap_servers": kafka_bootstrap}, [pipeline.topics.shards])
    try:
        records = reader.read_to_end()[pipeline.topics.shards]
    finally:
        reader.close()
    first = {control_kind(r.headers): r.offset for r in reversed(records)}  # the first of each kind
    for control, expected in ((None, "shards"), ("batch-skipped", "why")):  # a batch; the faults' refused one
        result = CliRunner().invoke(app_of(inspect_command), [f"{pipeline.topics.shards}:0:{first[control]}",
                                                              "--json", "--bootstrap-servers", kafka_bootstrap])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["decoded_as"] == "json" and expected in doc["json"]


@pytest.mark.parametrize("position, message", [
    pytest.param("{turns}:0", "TOPIC:PARTITION:OFFSET", id="bad-syntax"),
    pytest.param("{turns}:0:999999", "'offset' must be in", id="offset-out-of-range"),
    pytest.param("{turns}:99:0", "'partition' must be one of", id="no-such-partition"),
])
def test_inspect_refuses_bad_input_with_a_clear_error_and_a_nonzero_exit(kafka_bootstrap, pipeline, position,
                                                                         message):
    target = position.format(turns=pipeline.topics.turns)
    result = CliRunner().invoke(app_of(inspect_command), [target, "--bootstrap-servers", kafka_bootstrap])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_inspecting_an_undecodable_record_names_where_it_is(kafka_bootstrap, dead_letters):
    source = next(d["dlq"]["source"] for d in dead_letters if d["dlq"]["kind"] == "decode")
    with pytest.raises(CodecError, match=f"record {source} does not decode as turns"):
        inspect_position({"bootstrap_servers": kafka_bootstrap}, source)
