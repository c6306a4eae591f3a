"""Record shapes: rollout keys parsed back, and the control records that close groups and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_bus.errors import ContractError
from rollout_bus.wire.records import (Abandoned, BatchesEnded, BatchSkipped, EndOfRun, ShardAnnouncement,
                                      WeightVersion, announcement_value, parse_announcement)
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.rollout_key import parse_rollout_key, rollout_key_adapter
from rollout_bus.model.sample import AdapterRef
from rollout_bus.wire.rollout_key import rollout_key_string


@pytest.mark.parametrize("key", [
    (AdapterRef("math", 1), "rollout", 3, 17),
    (None, "rollout", 0, 0),
    (None, "sample", 12, 5),
    (AdapterRef('we"ird, name', 0), "rollout", 1, 2),
])
def test_a_rollout_key_string_parses_back_to_its_tuple(key):
    assert parse_rollout_key(rollout_key_string(key).encode()) == key
    assert parse_rollout_key(rollout_key_string(key)) == key


@pytest.mark.parametrize("raw", [
    None, b"", b"\xff\xfe", b"not json", b"[1,2,3,4]", b'{"a":1}',
    b'[null,null,"rollout",-1,0]', b'[null,null,"position",1,0]', b'[null,null,"rollout",1.5,0]',
    b'["a",null,"rollout",1,0]', b'[null,3,"rollout",1,0]', b'[null,null,"rollout",true,0]',
    b'[null,null,"rollout",1,"x"]',
])
def test_a_key_that_is_not_a_rollout_key_is_refused_with_the_reason(raw):
    with pytest.raises(ContractError, match="record key"):
        parse_rollout_key(raw)


def test_control_records_are_told_apart_from_data_records_by_their_header():
    assert control_kind(TurnHeaders(0, 0, True, 1, 0).to_kafka()) is None
    assert control_kind(None) is None
    assert control_kind(EndOfRun("r").headers()) == "end-of-run"
    assert control_kind(Abandoned(0, 2, "gap", "why", "t:0:1").headers()) == "abandoned"


def test_control_records_round_trip():
    marker = EndOfRun("run-7").forwarded(2, 4)
    assert EndOfRun.from_value(marker.value()) == marker
    assert EndOfRun.from_value(EndOfRun("x").value()) == EndOfRun("x")
    abandoned = Abandoned(1, 4, "too_large", "over the limit", "turns:3:99")
    assert Abandoned.from_value(abandoned.value()) == abandoned


@pytest.mark.parametrize("cls, value", [
    (EndOfRun, None), (EndOfRun, b"[]"), (EndOfRun, b"{}"), (EndOfRun, b'{"run": 3}'),
    (EndOfRun, b'{"run": "r", "turns_partition": "1"}'),
    (Abandoned, b'{"attempt": 0}'), (Abandoned, b"garbage"),
    (Abandoned, b'{"attempt": -1, "group_size": 1, "kind": "k", "reason": "r", "source": "s"}'),
    (Abandoned, b'{"attempt": 0, "group_size": 0, "kind": "k", "reason": "r", "source": "s"}'),
    (Abandoned, b'{"attempt": true, "group_size": 1, "kind": "k", "reason": "r", "source": "s"}'),
])
def test_a_malformed_control_record_is_refused_naming_what_is_wrong(cls, value):
    with pytest.raises(ContractError):
        cls.from_value(value)


def test_a_rollout_key_string_names_its_adapter_and_anything_else_names_none():
    assert rollout_key_adapter('["math",0,"rollout",3,17]') == "math"
    assert rollout_key_adapter(b'["math",1,"rollout",0,3]') == "math"
    assert rollout_key_adapter(b'[null,null,"rollout",3,17]') is None
    assert rollout_key_adapter(b"\xff not json") is None and rollout_key_adapter(None) is None
    assert rollout_key_adapter(b'["math",1,"position",0,3]') is None  # not a rollout key on the wire


def test_a_shard_announcement_round_trips_and_other_records_are_not_announcements():
    manifest = {"seq": 4, "shards": [{"path": "dp-0.safetensors"}], "metrics": {"x": 1.5}}
    value = announcement_value(ShardAnnouncement(manifest, "/out/batch-000004", "/out/batch-000004/manifest.json",
                                                 "ab" * 32))
    assert value == json.dumps(json.loads(value), sort_keys=True, separators=(",", ":")).encode()
    parsed = parse_announcement(value)
    assert parsed == ShardAnnouncement(manifest, "/out/batch-000004", "/out/batch-000004/manifest.json", "ab" * 32)
    assert parsed.seq == 4
    for other in (None, b"", b"\xff", b"[1]", b'{"seq": 4}', b'{"rollout/x": 1}',
                  json.dumps({**manifest, "dir": 3, "manifest_path": "p", "manifest_sha256": "s"}).encode()):
        assert parse_announcement(other) is None


def test_an_announced_batch_lies_under_the_readers_root_or_else_the_writers():
    manifest = {"seq": 3, "shards": []}
    relative = parse_announcement(announcement_value(
        ShardAnnouncement(manifest, "batch-00000003", "batch-00000003/manifest.json", "ab" * 32, "/data/shards")))
    assert relative.out_root == "/data/shards"
    assert relative.batch_dir() == Path("/data/shards/batch-00000003")
    assert relative.batch_dir("/mnt/rollouts") == Path("/mnt/rollouts/batch-00000003")
    older = parse_announcement(announcement_value(  # written before out_root: absolute paths
        ShardAnnouncement(manifest, "/out/batch-00000003", "/out/batch-00000003/manifest.json", "ab" * 32)))
    assert older.out_root is None and b"out_root" not in announcement_value(older)
    assert older.batch_dir() == Path("/out/batch-00000003")
    assert older.batch_dir("/mnt/rollouts") == Path("/mnt/rollouts/batch-00000003")
    assert older.batch_name == relative.batch_name == "batch-00000003"


def test_a_weight_version_round_trips_and_a_bad_one_is_refused_by_field():
    record = WeightVersion(3, 2, 1_700_000_000_000)
    assert WeightVersion.from_value(record.value()) == record
    assert record.value() == b'{"published_at":1700000000000,"step":2,"version":3}'
    for bad, field in ((b'{"version":-1,"step":0,"published_at":0}', "version"),
                       (b'{"version":1,"step":0}', "published_at"), (b"not json", "weights")):
        with pytest.raises(ContractError, match=field):
            WeightVersion.from_value(bad)


def test_skipped_batches_and_the_end_of_a_run_on_rollout_shards_round_trip():
    skipped = BatchSkipped(4, "empty", "every group abandoned")
    assert BatchSkipped.from_value(skipped.value()) == skipped and skipped.key() == b"4"
    assert control_kind(skipped.headers()) == "batch-skipped"
    ended = BatchesEnded("run-1", 7)
    assert BatchesEnded.from_value(ended.value()) == ended and control_kind(ended.headers()) == "end-of-run"
    with pytest.raises(ContractError, match="seq"):
        BatchSkipped.from_value(b'{"seq":-1,"why":"empty","reason":""}')


@pytest.mark.parametrize("raw", [b" 5", b"+5", b"1_0", b"", b"5\n", b"\xd9\xa5", b"0x5"])
def test_a_turn_header_integer_is_ascii_digits_and_nothing_else(raw):
    headers = [(k, raw if k == "turn" else v) for k, v in TurnHeaders(5, 0, False, 1, 7).to_kafka()]
    with pytest.raises(ContractError, match="'turn' must be a decimal integer in ASCII digits"):
        TurnHeaders.from_kafka(headers)
