"""WIRE.md's JSON Schemas (``schemas/*.json``) against what the code itself emits, offline.

A small pipeline runs without a broker: the built-in generator's turns (adapters, tool calls, compaction,
retries, removed samples, a replay gap) go through the stream stage's own ``TurnProcessor`` into a sink,
and its episode records through the shard writer's own batcher, convert and write steps into ``tmp_path``.
Every document on the way (samples metadata, headers, window and batch metrics, manifests, announcements,
control records, dead-letter headers, weight versions) must match its schema, and broken copies must not,
so a drift between code and spec fails here. The safetensors layout claims of WIRE.md section 4.3 and the
shard tensors of section 8.3 are checked on the bytes too, and the section 13 example is run.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from jsonschema import Draft202012Validator

from rollout_bus.config import ShardSettings
from rollout_bus.consumers.shard_writer.batcher import Batcher
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.consumers.shard_writer.batch import Batch
from rollout_bus.consumers.shard_writer.episodes import AbandonedEpisode, EndOfRunMarker, Episode, parse_record
from rollout_bus.consumers.shard_writer.out_dir import announcement, convert_batch, manifest_place, write_batch
from rollout_bus.consumers.shard_writer.dead_letters import STAGE as SHARDS_STAGE
from rollout_bus.consumers.shard_writer.batch import split_stale
from rollout_bus.sim.faults import MALFORMED_VALUE
from rollout_bus.sim.generator import iter_turns
from rollout_bus.wire.codec import decode_samples, encode_samples
from rollout_bus.config import GenerateSettings
from rollout_bus.wire.dead_letter import DeadLetter, source_of
from rollout_bus.errors import ContractError, MaskCheckError
from rollout_bus.wire.control_records import BatchesEnded, BatchSkipped, EndOfRun
from rollout_bus.wire.episode_record import TURN_FIELDS, decode_episode
from rollout_bus.wire.flow_metrics import flow_metrics_record, generator_flow
from rollout_bus.wire.metrics_records import batch_metrics_record
from rollout_bus.wire.shard_announcement import ShardAnnouncement, announcement_value
from rollout_bus.wire.weight_version import WeightVersion
from rollout_bus.wire.prompt_record import LedgerEvent, PromptGroup
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.wire.topics import Topics
from rollout_bus.wire.headers import HEADER_REROUTED_FROM
from rollout_bus.wire.rollout_key import rollout_key_of, rollout_key_string
from rollout_bus.model.shards import batch_path
from rollout_bus.streams.processor import TurnProcessor
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.turn_record import TurnRecord
from tests.unit.streams.test_episode_state import _Sink
from tests.wire_schemas import ID_BASE, header_object, problems, schemas, validate

REPO = Path(__file__).resolve().parents[3]
TOPICS = Topics(prefix="wire.")
RUN = "wire-run"
SENT_AT_MS = 1_767_225_600_000
BROKEN_VALUE = b"not a samples payload"
WINDOW_MS = 1_000
SETTINGS = GenerateSettings(episodes=24, n_samples_per_prompt=4, adapters="math,code", max_turns=3,
                            vocab_size=4096, min_response_len=4, max_response_len=24, tool_call_prob=0.5,
                            compaction_prob=0.3, retry_prob=0.2, remove_prob=0.1, inject_faults=True, seed=5,
                            run_id=RUN)
ITEMSIZE = {"U8": 1, "I32": 4, "I64": 8, "F64": 8}
WIRE_DTYPES = {"tokens": "I64", "loss_mask": "U8", "rollout_log_probs": "F64", "rollout_token_versions": "I64",
               "rollout_sampling_mask.offsets": "I64", "rollout_sampling_mask.ids": "I32"}
SHARD_DTYPES = {"tokens": "I32", "tokens_offsets": "I64", "response_lengths": "I64", "loss_masks": "U8",
                "rollout_log_probs": "F32", "rollout_token_versions": "I64", "rollout_sampling_mask_offsets": "I64",
                "rollout_sampling_mask_ids": "I32", "rewards": "F32", "raw_rewards": "F32", "truncated": "U8",
                "rollout_ids": "I64", "sample_indices": "I64", "group_indices": "I64", "adapter_slots": "I64",
                "partition": "I64"}


# ---------------------------------------------------------------------------- reading the bytes


def safetensors_header(payload: bytes) -> tuple[int, dict[str, Any]]:
    """(header length, header JSON) of a safetensors buffer, read as WIRE.md 4.3 says, without the codec."""
    length = int.from_bytes(payload[:8], "little")
    return length, json.loads(payload[8:8 + length])


def samples_meta(payload: bytes) -> dict[str, Any]:
    """The ``_samples_meta`` document of a samples payload (NaN tokens parse, as WIRE.md 4.4 requires)."""
    length, header = safetensors_header(payload)
    begin, end = header["_samples_meta"]["data_offsets"]
    return json.loads(payload[8 + length + begin:8 + length + end].decode("utf-8"))


# ---------------------------------------------------------------------------- the offline pipeline


@dataclasses.dataclass
class OfflineRun:
    """What the stages emitted: records per topic (key, value, headers) and the shard writer's outputs."""

    turns: list[TurnRecord]  # every record sent to rollout.turns, faults and the end-of-run marker included
    sent: list[tuple[str, bytes | None, bytes | None, list]]
    out: Path
    manifests: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    announcements: list[bytes] = dataclasses.field(default_factory=list)
    batch_metrics: list[bytes] = dataclasses.field(default_factory=list)
    skipped: list[BatchSkipped] = dataclasses.field(default_factory=list)
    writer_letters: list[DeadLetter] = dataclasses.field(default_factory=list)
    ended: BatchesEnded | None = None

    def on(self, topic: str) -> list[tuple[str, bytes | None, bytes | None, list]]:
        return [s for s in self.sent if s[0] == topic]

    def good_turns(self) -> list[TurnRecord]:
        """The generator's own turns that decode (the replay-gap one included)."""
        return [r for r in self.turns if control_kind(r.headers) is None and r.value not in (BROKEN_VALUE,
                                                                                               MALFORMED_VALUE)
                and dict(r.headers)["turn"] != b"9"]


def turn_records(settings: GenerateSettings) -> list[TurnRecord]:
    """The generator's turns as the publisher would send them, all on partition 0, 50 ms apart."""
    records = []
    for offset, (sample, args) in enumerate(iter_turns(settings)):
        key = rollout_key_of(sample).encode()
        headers = TurnHeaders(args["turn"], args["attempt"], args["final"], args["group_size"],
                              SENT_AT_MS + offset).to_kafka()
        records.append(TurnRecord(key, encode_samples([sample], TURN_FIELDS), headers, TOPICS.turns, 0, offset,
                                  SENT_AT_MS + 50 * offset))
    return records


def with_faults(records: list[TurnRecord]) -> list[TurnRecord]:
    """The faults ``--inject-faults`` sends beside the replay gap (a turn for a finished episode, a malformed
    value), a broken final turn inside a real group (an abandoned episode in a written batch), the end of run."""
    records = list(records)
    broken = next(i for i, r in enumerate(records)  # a multi-turn episode of group 3 (batch 1 passes its checks)
                  if _final(r) and b',"rollout",3,' in r.key and dict(r.headers)["turn"] != b"0")
    records[broken] = dataclasses.replace(records[broken], value=BROKEN_VALUE)
    last = records[-1]
    finished = next(r for r in records if _final(r))
    late = TurnRecord(finished.key, finished.value,
                      TurnHeaders(9, 0, False, 4, SENT_AT_MS).to_kafka(), TOPICS.turns, 0, last.offset + 1,
                      last.timestamp_ms + 50)
    malformed_key = rollout_key_string((None, "rollout", 1_000_000, 0)).encode()
    malformed = TurnRecord(malformed_key, MALFORMED_VALUE, TurnHeaders(0, 0, True, 1, SENT_AT_MS).to_kafka(),
                           TOPICS.turns, 0, last.offset + 2, last.timestamp_ms + 100)
    marker = EndOfRun(RUN)
    end = TurnRecord(b"end-of-run", marker.value(), marker.headers(), TOPICS.turns, 0, last.offset + 3,
                     last.timestamp_ms + 10 * WINDOW_MS)
    return records + [late, malformed, end]


def _final(record: TurnRecord) -> bool:
    return dict(record.headers).get("final") == b"1"


def run_stream(records: list[TurnRecord]) -> list[tuple[str, bytes | None, bytes | None, list]]:
    """The stream stage's per-record logic over ``records``; everything it would send."""
    sink = _Sink()
    processor = TurnProcessor(ChangelogState({}), sink, TOPICS, window_ms=WINDOW_MS, grace_ms=0,
                              turns_partitions=1, episodes_partitions=1)

    async def go() -> None:
        await processor.handle_batch(records)
        await processor.drain_idle()

    asyncio.run(go())
    return sink.sent


def write_batches(run: OfflineRun) -> None:
    """The shard writer's steps (rollout_bus.consumers.shard_writer.writer._write) over the emitted episode records."""
    batcher = Batcher(RunBatching(2, "step"))
    for offset, (_topic, key, value, headers) in enumerate(run.on(TOPICS.episodes)):
        item = parse_record(key, value, headers, partition=0, offset=offset)
        if isinstance(item, EndOfRunMarker):
            continue
        batcher.add(item)
        for batch in batcher.ready():
            write_one(run, batch)
    for batch in batcher.flush():
        write_one(run, batch)
    run.ended = BatchesEnded(RUN, batcher.next_seq)


def write_one(run: OfflineRun, batch: Batch, *, max_staleness: int | None = None) -> dict[str, Any] | None:
    """One batch as the writer handles it: skipped when empty, dead-lettered when refused, else written and
    announced (with its batch metrics record); the manifest, or None."""
    batch = split_stale(batch, max_staleness)
    if batch.empty:
        run.skipped.append(BatchSkipped(batch.seq, "empty", f"every episode of it was abandoned "
                                                            f"({len(batch.abandoned)} abandoned)"))
        return None
    try:
        samples, ranks = convert_batch(batch, dp_size=2, normalization="grpo")
    except ContractError as exc:
        kind = "mask-check" if isinstance(exc, MaskCheckError) else "convert"
        for episode in batch.episodes:
            run.writer_letters.append(DeadLetter(episode.key.encode(), episode.value, list(episode.headers),
                                                 f"batch {batch.seq} failed the whole-batch check: {exc}",
                                                 SHARDS_STAGE, kind, source_of(TOPICS.episodes, 0, episode.offset)))
        run.skipped.append(BatchSkipped(batch.seq, "dead-lettered", f"{kind}: {exc}"))
        return None
    manifest = write_batch(run.out, batch, samples, ranks, topic=TOPICS.episodes, batching="step",
                           normalization="grpo", max_staleness=max_staleness)
    directory = batch_path(run.out, batch.seq)
    run.manifests.append(manifest)
    run.batch_metrics.append(batch_metrics_record(batch.seq, manifest["metrics"], samples=manifest["num_samples"],
                                                  manifest_path=manifest_place(directory)))
    run.announcements.append(announcement(manifest, directory))
    return manifest


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> OfflineRun:
    turns = with_faults(turn_records(SETTINGS))
    run = OfflineRun(turns, run_stream(turns), tmp_path_factory.mktemp("shards"))
    write_batches(run)
    return run


# ---------------------------------------------------------------------------- the schemas themselves


@pytest.mark.parametrize("name", sorted(schemas()))
def test_every_schema_is_a_valid_draft_2020_12_schema_with_id_title_and_description(name):
    schema = schemas()[name]
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"{ID_BASE}{name}.json"
    assert schema["title"].strip() and schema["description"].strip()


def test_wire_md_names_every_schema_file_and_only_existing_ones():
    text = (REPO / "WIRE.md").read_text()
    named = set(re.findall(r"schemas/([a-z_]+)\.json", text))
    assert named == set(schemas()), (sorted(named - set(schemas())), sorted(set(schemas()) - named))


# ---------------------------------------------------------------------------- rollout.turns


def test_every_turn_the_generator_sends_has_a_valid_key_headers_and_samples_metadata(offline):
    turns = offline.good_turns()
    assert len(turns) > 30
    for record in turns:
        validate("rollout_key", record.key.decode("ascii"))
        validate("turn_headers", header_object(record.headers))
        meta = samples_meta(record.value)
        validate("samples_meta", meta)
        assert meta["metadata"] == {} and len(meta["samples"]) == 1
    seen = [samples_meta(r.value)["samples"][0] for r in turns]
    assert {s["adapter"][0] for s in seen} == {"math", "code"}
    assert any(s["remove_sample"] for s in seen) and any(s["nulls"] for s in seen)  # removed; the replay gap
    assert {s["status"] for s in seen} >= {"completed", "truncated"}


def test_a_turn_payload_is_laid_out_as_wire_md_says(offline):
    """8-byte length, space-padded header without __metadata__, widest dtypes first, tensors tiling the data
    in header order and aligned to their item size, meta last; names and dtypes as in WIRE.md 4.3."""
    for record in offline.good_turns():
        length, header = safetensors_header(record.value)
        raw = record.value[8:8 + length]
        text = raw.rstrip(b" ")  # compact JSON, then spaces up to a multiple of 8
        assert length % 8 == 0 and len(raw) - len(text) < 8 and text.endswith(b"}") and b" " not in text
        assert json.loads(text) == header and "__metadata__" not in header
        names, position, widths = list(header), 0, []
        for name in names:
            entry = header[name]
            begin, end = entry["data_offsets"]
            assert begin == position and (8 + length + begin) % ITEMSIZE[entry["dtype"]] == 0
            assert end - begin == entry["shape"][0] * ITEMSIZE[entry["dtype"]] and len(entry["shape"]) == 1
            position, widths = end, widths + [ITEMSIZE[entry["dtype"]]]
            if name != "_samples_meta":
                field, index = name.rsplit(".", 1)
                assert index == "0" and WIRE_DTYPES[field] == entry["dtype"], name
        assert 8 + length + position == len(record.value)
        assert names[-1] == "_samples_meta" and header["_samples_meta"]["dtype"] == "U8"
        assert widths == sorted(widths, reverse=True)


VECTORS = REPO / "tests" / "vectors"


@pytest.mark.parametrize("name", sorted(p.name.removesuffix(".key") for p in VECTORS.glob("*.key")))
def test_every_golden_vector_matches_the_schemas(name):
    """The golden records of tests/vectors/ (exact bytes) are documents of these schemas too."""
    key = (VECTORS / f"{name}.key").read_bytes()
    headers = {k: v for k, v in json.loads((VECTORS / f"{name}.headers.json").read_text())}
    value = (VECTORS / f"{name}.value.bin").read_bytes()
    if headers.get("control") == "end-of-run":
        assert key == b"end-of-run"
        validate("end_of_run", json.loads(value))
        return
    record = json.loads((VECTORS / f"{name}.decoded.json").read_text())["record"]
    if record in ("prompt-group", "ledger-event"):  # WIRE.md section 15
        assert headers == {"schema": "1"}
        validate(record.replace("-", "_"), json.loads(value))
        return
    validate("rollout_key", key.decode("ascii"))
    validate("turn_headers", headers)
    validate("samples_meta", samples_meta(value))


def test_a_minimal_sample_with_nulls_a_nan_reward_and_unicode_matches_the_schema():
    sample = Sample(group_index=0, index=3, tokens=[5, 6], response_length=0, reward=math.nan,
                    prompt=[{"role": "user", "content": "ß"}], metadata={"raw_reward": math.inf},
                    status=Status.FAILED, adapter=AdapterRef("mäth", 0))
    payload = encode_samples([sample], TURN_FIELDS)
    assert b'"reward":NaN' in payload and b'"raw_reward":Infinity' in payload  # WIRE.md 4.4: bare tokens
    meta = samples_meta(payload)
    validate("samples_meta", meta)
    assert meta["samples"][0]["nulls"] == ["loss_mask", "rollout_log_probs", "rollout_sampling_mask"]
    key = rollout_key_of(sample)
    assert key == '["m\\u00e4th",0,"sample",0,3]'
    validate("rollout_key", key)


def test_turn_headers_with_a_delivery_match_the_schema_and_a_delivery_of_0_is_refused_by_both():
    """WIRE.md 4.2: ``delivery`` is optional, ASCII decimal >= 1 (absent for generators that plan their groups)."""
    headers = TurnHeaders(0, 0, False, 4, SENT_AT_MS, generator="g0of2-seed1", delivery=2).to_kafka()
    assert headers[-1] == ("delivery", b"2")
    validate("turn_headers", header_object(headers))
    assert "delivery" not in header_object(TurnHeaders(0, 0, False, 4, SENT_AT_MS).to_kafka())
    zero = headers[:-1] + [("delivery", b"0")]
    assert problems("turn_headers", header_object(zero))
    with pytest.raises(ContractError):
        TurnHeaders.from_kafka(zero)


def test_a_re_routed_copy_keeps_its_headers_and_adds_rerouted_from():
    """WIRE.md section 3, on the stream stage's own code: a turn on the wrong partition goes to its key's."""
    from rollout_bus.wire.partitioning import partition_for

    record = turn_records(GenerateSettings(episodes=1, n_samples_per_prompt=1, max_turns=1, vocab_size=4096,
                                           min_response_len=4, max_response_len=8))[0]
    home = partition_for(record.key, 4)
    misplaced = dataclasses.replace(record, partition=(home + 1) % 4, offset=12)
    sink = _Sink()
    processor = TurnProcessor(ChangelogState({}), sink, TOPICS, window_ms=WINDOW_MS, grace_ms=0,
                              turns_partitions=4)
    asyncio.run(processor.handle_batch([misplaced]))
    (topic, key, value, headers), = sink.sent
    assert (topic, key, value, sink.partitions) == (TOPICS.turns, record.key, record.value, [home])
    assert headers == [*record.headers, (HEADER_REROUTED_FROM, f"{TOPICS.turns}:{(home + 1) % 4}:12".encode())]
    validate("turn_headers", header_object(headers))


# ---------------------------------------------------------------------------- rollout.episodes


def test_every_episode_record_matches_its_schemas(offline):
    episodes = [s for s in offline.on(TOPICS.episodes) if control_kind(s[3]) is None]
    assert len(episodes) >= 20
    multi = 0
    for _topic, key, value, headers in episodes:
        validate("rollout_key", key.decode("ascii"))
        validate("episode_headers", header_object(headers))
        meta = samples_meta(value)
        validate("samples_meta", meta)
        validate("episode_meta", meta["metadata"])
        segments, info = decode_episode(value)
        assert meta["metadata"]["episode"] == dataclasses.asdict(info)
        multi += len(segments) > 1
    assert multi, "no episode with several segments: the schemas were not tried on one"


def test_abandoned_and_forwarded_end_of_run_records_match_their_schemas(offline):
    controls = [(control_kind(h), k, v) for _t, k, v, h in offline.on(TOPICS.episodes) if control_kind(h)]
    abandoned = [(k, json.loads(v)) for kind, k, v in controls if kind == "abandoned"]
    ends = [json.loads(v) for kind, _k, v in controls if kind == "end-of-run"]
    assert {doc["kind"] for _, doc in abandoned} >= {"decode"} and len(ends) == 1
    for key, doc in abandoned:
        validate("rollout_key", key.decode("ascii"))
        validate("abandoned", doc)
    validate("end_of_run", ends[0])
    assert ends[0] == {"run": RUN, "turns_partition": 0, "turns_partitions": 1}
    validate("end_of_run", json.loads(EndOfRun(RUN).value()))  # as the generator sends it on rollout.turns


# ---------------------------------------------------------------------------- rollout.metrics


def test_window_metrics_records_and_their_stats_match_their_schemas(offline):
    windows = [json.loads(v) for _t, _k, v, _h in offline.on(TOPICS.metrics)]
    assert {w["closed"] for w in windows} == {False, True}
    assert {w["adapter"] for w in windows} == {"math", "code"}
    for doc in windows:
        validate("window_metrics", doc)
        validate("episode_stats", json.loads(doc["stats"]))
    keys = {k for _t, k, _v, _h in offline.on(TOPICS.metrics)}
    assert all(re.fullmatch(rb"window:[0-9]+-[0-9]+", k) for k in keys)


def test_batch_metrics_records_match_their_schema(offline):
    assert offline.batch_metrics
    for value in offline.batch_metrics:
        doc = json.loads(value)
        validate("batch_metrics", doc)
        assert re.fullmatch(r"batch-[0-9]{8}/manifest\.json", doc["manifest"])


# ---------------------------------------------------------------------------- manifests, announcements, shards


def test_every_manifest_on_disk_and_every_announcement_match_their_schemas(offline):
    assert len(offline.manifests) >= 2
    on_disk = sorted(offline.out.glob("batch-*/manifest.json"))
    assert len(on_disk) == len(offline.manifests)
    for path in on_disk:
        validate("manifest", json.loads(path.read_text()))
    for value in offline.announcements:
        doc = json.loads(value)
        validate("shard_announcement", doc)
        assert doc["dir"] == doc["batch"] and doc["manifest_path"] == f"{doc['batch']}/manifest.json"
        assert Path(doc["out_root"]) == offline.out.resolve()
    extras = [m["extra"] for m in offline.manifests]
    assert any(e["abandoned"] for e in extras), "no manifest lists an abandoned episode"
    assert any(g["adapter"] is not None for e in extras for g in e["groups"])


def test_an_announcement_written_before_out_root_still_matches_and_a_mixed_one_does_not(offline):
    manifest = offline.manifests[0]
    absolute = str(offline.out.resolve() / manifest["batch"])
    older = announcement_value(ShardAnnouncement(manifest, absolute, f"{absolute}/manifest.json", "ab" * 32))
    validate("shard_announcement", json.loads(older))
    mixed = json.loads(older) | {"out_root": str(offline.out.resolve())}  # out_root with an absolute dir
    assert problems("shard_announcement", mixed)


def test_a_manifest_listing_stale_episodes_matches_its_schema(offline, tmp_path):
    """The staleness net's entries (extra.stale), from a real batch whose later episodes carry newer versions."""
    batches = Batcher(RunBatching(2, "step"))
    for offset, (_topic, key, value, headers) in enumerate(offline.on(TOPICS.episodes)):
        item = parse_record(key, value, headers, partition=0, offset=offset)
        if isinstance(item, (Episode, AbandonedEpisode)):
            batches.add(item)
    batch = next(b for b in batches.flush() if len(b.episodes) >= 2 and _converts(b))
    newer = tuple(dataclasses.replace(e, segments=tuple(_at_version(s, 10) for s in e.segments))
                  for e in batch.episodes[len(batch.episodes) // 2:])
    batch = dataclasses.replace(batch, seq=3, episodes=batch.episodes[:len(batch.episodes) // 2] + newer)
    run = OfflineRun([], [], tmp_path)
    manifest = write_one(run, batch, max_staleness=1)
    assert manifest is not None and manifest["extra"]["stale"] and manifest["extra"]["max_staleness"] == 1
    validate("manifest", json.loads((batch_path(tmp_path, 3) / "manifest.json").read_text()))
    validate("shard_announcement", json.loads(run.announcements[0]))
    validate("batch_metrics", json.loads(run.batch_metrics[0]))
    assert any(k.endswith("/staleness/max") for k in json.loads(run.batch_metrics[0])["metrics"])


def _converts(batch: Batch) -> bool:
    """Whether the batch passes the whole-batch checks (the replay-gap batch does not)."""
    try:
        convert_batch(batch, dp_size=2, normalization="grpo")
    except ContractError:
        return False
    return True


def _at_version(sample: Sample, version: int) -> Sample:
    changed = copy.copy(sample)
    if sample.rollout_token_versions is not None:
        versions = np.asarray(sample.rollout_token_versions)
        changed.rollout_token_versions = np.where(versions >= 0, version, versions)
    changed.weight_versions = [str(version) for _ in sample.weight_versions]
    return changed


def test_shard_files_hold_the_tensors_wire_md_lists(offline):
    """WIRE.md 8.3: names and dtypes, rank 1, the rollout_bus metadata, and the per-sample CSR rebasing."""
    shards = sorted(offline.out.glob("batch-*/dp-*.safetensors"))
    assert shards
    for path in shards:
        length, header = safetensors_header(path.read_bytes())
        meta = header.pop("__metadata__")
        assert json.loads(meta["rollout_bus"])["format_version"] == 1
        for name, entry in header.items():
            assert SHARD_DTYPES[name] == entry["dtype"] and len(entry["shape"]) == 1, (path, name)
        with safetensors.safe_open(str(path), framework="numpy") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        lengths, offsets = tensors["response_lengths"], tensors["rollout_sampling_mask_offsets"]
        assert offsets.size == int(lengths.sum()) + 1 and tensors["loss_masks"].size == int(lengths.sum())
        assert list(tensors["partition"]) == sorted(tensors["partition"])
        start = 0
        for i, n in enumerate(lengths.tolist()):  # each sample's mask: a slice of the shard-wide CSR, rebased
            local = offsets[start:start + n + 1] - offsets[start]
            RolloutSamplingMask(tensors["rollout_sampling_mask_ids"][offsets[start]:offsets[start + n]], local)
            start += n


# ---------------------------------------------------------------------------- rollout.shards control, dlq, weights


def test_shards_control_records_and_weight_versions_match_their_schemas(offline):
    assert {s.why for s in offline.skipped} == {"empty", "dead-lettered"}
    for skipped in offline.skipped:
        validate("batch_skipped", json.loads(skipped.value()))
        assert dict(skipped.headers())["control"] == b"batch-skipped"
    validate("batches_ended", json.loads(offline.ended.value()))
    validate("weight_version", json.loads(WeightVersion(3, 2, SENT_AT_MS).value()))


def test_dead_letter_headers_of_both_stages_match_the_schema(offline):
    stream = [DeadLetter.from_record(k, v, h) for _t, k, v, h in offline.on(TOPICS.dlq)]
    assert {d.kind for d in stream} >= {"decode", "finished", "abandoned"}
    assert {d.kind for d in offline.writer_letters} == {"mask-check"}
    for letter in stream + offline.writer_letters:
        headers = header_object(letter.record_headers())
        validate("dlq_headers", headers)
        assert headers["dlq.source"].startswith(TOPICS.turns if letter.stage == "stream" else TOPICS.episodes)
    long = DeadLetter(b"k", None, [("turn", b"0")], "x" * 9000, "stream", "too_large", "t:0:1")
    validate("dlq_headers", header_object(long.record_headers()))  # the reason is cut at 4000


# ---------------------------------------------------------------------------- the schemas can fail


def _without(doc: dict, key: str) -> dict:
    return {k: v for k, v in doc.items() if k != key}


def _nested(doc: dict, path: list, value: Any) -> dict:
    changed = copy.deepcopy(doc)
    target = changed
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return changed


@pytest.fixture(scope="module")
def valid_documents(offline) -> dict[str, Any]:
    """One real document per schema, each produced by the code above."""
    episode = next(v for _t, _k, v, h in offline.on(TOPICS.episodes) if control_kind(h) is None)
    abandoned = next(v for _t, _k, v, h in offline.on(TOPICS.episodes) if control_kind(h) == "abandoned")
    window = json.loads(next(v for _t, _k, v, _h in offline.on(TOPICS.metrics)))
    letter = next(DeadLetter.from_record(k, v, h) for _t, k, v, h in offline.on(TOPICS.dlq))
    return {
        "samples_meta": samples_meta(offline.turns[0].value),
        "episode_meta": samples_meta(episode)["metadata"],
        "rollout_key": offline.turns[0].key.decode(),
        "turn_headers": header_object(offline.turns[0].headers),
        "episode_headers": header_object(next(h for _t, _k, _v, h in offline.on(TOPICS.episodes))),
        "window_metrics": window,
        "episode_stats": json.loads(window["stats"]),
        "batch_metrics": json.loads(offline.batch_metrics[0]),
        "manifest": offline.manifests[0],
        "shard_announcement": json.loads(offline.announcements[0]),
        "dlq_headers": header_object(letter.record_headers()),
        "end_of_run": json.loads(EndOfRun(RUN, 0, 4).value()),
        "abandoned": json.loads(abandoned),
        "batch_skipped": json.loads(offline.skipped[0].value()),
        "batches_ended": json.loads(offline.ended.value()),
        "weight_version": json.loads(WeightVersion(3, 2, SENT_AT_MS).value()),
        "run_batching": json.loads(ShardSettings().run_batching("shard writer@host:12").value()),
        "flow_metrics": json.loads(flow_metrics_record("generator", "g0of1-seed7", generator_flow(1.5, 2, 10.0),
                                                       elapsed_s=10.0, final=False)),
        "prompt_group": json.loads(PromptGroup("p-1", 3, [5, 6], 4, label={"answer": 2}, sampling={"top_p": 0.9},
                                               adapter="math").value()),
        "ledger_event": json.loads(LedgerEvent("failed", "p-1", 3, "g0of1-seed7", reason="3 deliveries").value()),
    }


def test_every_schema_has_a_valid_document_here(valid_documents):
    assert set(valid_documents) == set(schemas())
    for name, doc in valid_documents.items():
        validate(name, doc)


BROKEN = [
    # (schema, how the valid document is broken, the path the failure names)
    ("samples_meta", lambda d: _without(d, "samples"), "$"),
    ("samples_meta", lambda d: _nested(d, ["samples", 0, "status"], "Completed"), "$.samples[0].status"),
    ("samples_meta", lambda d: _nested(d, ["samples", 0, "extra"], 1), "$.samples[0]"),
    ("samples_meta", lambda d: _nested(d, ["samples", 0, "adapter"], {"name": "math", "slot": 1}),
     "$.samples[0].adapter"),
    ("samples_meta", lambda d: _nested(d, ["samples", 0, "reward"], True), "$.samples[0].reward"),
    ("episode_meta", lambda d: _nested(d, ["episode"], _without(d["episode"], "attempt")), "$.episode"),
    ("episode_meta", lambda d: _nested(d, ["episode", "group_size"], "4"), "$.episode.group_size"),
    ("rollout_key", lambda d: d.replace(",", ", "), "$"),
    ("rollout_key", lambda d: d.replace('"rollout"', '"position"'), "$"),
    ("turn_headers", lambda d: _without(d, "schema"), "$"),
    ("turn_headers", lambda d: d | {"final": "true"}, "$.final"),
    ("turn_headers", lambda d: d | {"control": "end-of-run"}, "$"),
    ("episode_headers", lambda d: _without(d, "attempt"), "$"),
    ("episode_headers", lambda d: d | {"group_size": "0"}, "$.group_size"),
    ("episode_headers", lambda d: d | {"takeover_tokens": "0"}, "$.takeover_tokens"),  # absent when none
    ("window_metrics", lambda d: _without(d, "closed"), "$"),
    ("window_metrics", lambda d: d | {"episodes": "3"}, "$.episodes"),
    ("window_metrics", lambda d: _nested(d, ["metrics", "episode_raw_reward"], 0.5), "$.metrics"),
    ("episode_stats", lambda d: _without(d, "rewards"), "$"),
    ("episode_stats", lambda d: d | {"version": 2}, "$.version"),
    ("batch_metrics", lambda d: _without(d, "batch"), "$"),
    ("batch_metrics", lambda d: d | {"kind": "window"}, "$.kind"),
    ("manifest", lambda d: _without(d, "shards"), "$"),
    ("manifest", lambda d: _nested(d, ["shards", 0, "sha256"], "XYZ"), "$.shards[0].sha256"),
    ("manifest", lambda d: _nested(d, ["extra", "batching"], "eager"), "$.extra.batching"),
    ("shard_announcement", lambda d: _without(d, "manifest_sha256"), "$"),
    ("shard_announcement", lambda d: _without(d, "seq"), "$"),
    ("shard_announcement", lambda d: d | {"dir": 3}, "$.dir"),
    ("dlq_headers", lambda d: _without(d, "dlq.source"), "$"),
    ("dlq_headers", lambda d: d | {"dlq.stage": "stream", "dlq.kind": "mask-check"}, "$['dlq.kind']"),
    ("dlq_headers", lambda d: d | {"dlq.source": "rollout.turns:x:1"}, "$['dlq.source']"),
    ("end_of_run", lambda d: _without(d, "run"), "$"),
    ("end_of_run", lambda d: d | {"turns_partition": "0"}, "$.turns_partition"),
    ("abandoned", lambda d: _without(d, "source"), "$"),
    ("abandoned", lambda d: d | {"group_size": 0}, "$.group_size"),
    ("batch_skipped", lambda d: _without(d, "why"), "$"),
    ("batch_skipped", lambda d: d | {"seq": -1}, "$.seq"),
    ("batches_ended", lambda d: _without(d, "next_seq"), "$"),
    ("batches_ended", lambda d: d | {"run": None}, "$.run"),
    ("weight_version", lambda d: _without(d, "version"), "$"),
    ("weight_version", lambda d: d | {"step": 1.5}, "$.step"),
    ("run_batching", lambda d: _without(d, "declared_by"), "$"),
    ("run_batching", lambda d: d | {"batching": "eager"}, "$.batching"),
    ("run_batching", lambda d: d | {"max_staleness": -1}, "$.max_staleness"),
    ("flow_metrics", lambda d: _without(d, "source"), "$"),
    ("flow_metrics", lambda d: d | {"stage": "stream"}, "$.stage"),
    ("flow_metrics", lambda d: _nested(d, ["metrics", "rollout/episode_raw_reward"], 0.5), "$.metrics"),
    ("prompt_group", lambda d: _without(d, "input_ids"), "$"),
    ("prompt_group", lambda d: d | {"input_ids": []}, "$.input_ids"),
    ("prompt_group", lambda d: d | {"n_samples": 0}, "$.n_samples"),
    ("prompt_group", lambda d: d | {"prompt": "x"}, "$"),
    ("prompt_group", lambda d: _nested(d, ["sampling", "beam"], 2), "$.sampling"),
    ("ledger_event", lambda d: _without(d, "delivery"), "$"),
    ("ledger_event", lambda d: d | {"event": "started"}, "$.event"),
    ("ledger_event", lambda d: d | {"event": "loaded"}, "$.prompt"),
    ("ledger_event", lambda d: d | {"event": "claimed", "delivery": 0}, "$.delivery"),
    ("turn_headers", lambda d: d | {"delivery": "0"}, "$.delivery"),
]


@pytest.mark.parametrize("name, breakage, path", BROKEN, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BROKEN)])
def test_a_broken_document_fails_its_schema_naming_schema_and_path(valid_documents, name, breakage, path):
    broken = breakage(valid_documents[name])
    with pytest.raises(AssertionError) as failure:
        validate(name, broken)
    message = str(failure.value)
    assert repr(name) in message and f"{path}:" in message, message


def test_every_schema_has_broken_cases_here():
    assert {name for name, _, _ in BROKEN} == set(schemas())


# ---------------------------------------------------------------------------- WIRE.md section 13


def wire_example() -> dict[str, Any]:
    """The Python example of WIRE.md section 13, executed as a module (not as a script)."""
    text = (REPO / "WIRE.md").read_text()
    block = re.search(r"<!-- wire-example: confluent-kafka -->\s*```python\n(.*?)```", text, re.S)
    assert block, "WIRE.md lost its confluent-kafka example"
    namespace: dict[str, Any] = {"__name__": "wire_example"}
    exec(compile(block.group(1), "WIRE.md#13", "exec"), namespace)  # noqa: S102 - our own document
    return namespace


def test_the_wire_md_example_builds_the_bytes_the_encoder_builds():
    pytest.importorskip("confluent_kafka")
    value = wire_example()["turn_value"]()
    (sample,), metadata = decode_samples(value, TURN_FIELDS)
    assert metadata == {} and encode_samples([sample], TURN_FIELDS) == value
    assert rollout_key_of(sample) == '[null,null,"rollout",0,0]'
    assert sample.rollout_sampling_mask.row(2).tolist() == [9, 11, 12]
    validate("samples_meta", samples_meta(value))
