"""The rollout.shards announcement: its bytes round-trip, other records are not announcements, and the batch lies
under the reader's root or else the writer's."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_bus.wire.shard_announcement import ShardAnnouncement, announcement_value, parse_announcement


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
