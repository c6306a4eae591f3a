"""The rollout.shards announcement: a written batch's manifest and where it lies.

Why: the shard writer announces each batch it writes, and a trainer (``consumers.feed``), a replay and
the report find the batch from it, on the writer's machine or under a root of their own. Pure:
builds and parses bytes, talks to no broker.

Contract: compact, sorted JSON: a batch's manifest plus where it lies (``dir`` and ``manifest_path``
relative to the writer's output root, ``manifest_sha256``, and ``out_root``, the writer's own absolute
root: a hint for readers on its machine), built by ``announcement_value`` and read back by
``parse_announcement`` (None for a record that is not an announcement). The control records beside
them on rollout.shards are ``control_records``'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from rollout_bus.wire.compact_json import compact_json

ANNOUNCEMENT_PLACE = ("dir", "manifest_path", "manifest_sha256")
ANNOUNCEMENT_OUT_ROOT = "out_root"  # absent from announcements written before it existed (their dir is absolute)


@dataclass(frozen=True)
class ShardAnnouncement:
    """One rollout.shards record: a written batch's manifest and where it lies.

    ``dir`` and ``manifest_path`` are relative to the writer's output root (``batch-00000003``), so
    a trainer that mounts the shards elsewhere finds them under its own root; ``out_root`` is the
    writer's absolute root, used when the reader names none. Older announcements carry absolute
    paths and no ``out_root``: ``batch_dir`` reads both."""

    manifest: dict[str, Any]
    dir: str
    manifest_path: str
    manifest_sha256: str
    out_root: str | None = None

    @property
    def seq(self) -> int:
        return int(self.manifest["seq"])

    @property
    def batch_name(self) -> str:
        """The batch directory's own name, however ``dir`` was written."""
        return PurePath(self.dir).name

    def batch_dir(self, root: str | os.PathLike[str] | None = None) -> Path:
        """Where the batch lies for this reader: under ``root`` when given, else where the writer put it."""
        if root is not None:
            return Path(root) / self.batch_name
        return Path(self.out_root or "") / self.dir  # an absolute dir (older records) ignores the prefix


def announcement_value(announcement: ShardAnnouncement) -> bytes:
    """The rollout.shards value (compact, sorted JSON: the manifest's keys and the place keys)."""
    doc = {**announcement.manifest, "dir": announcement.dir, "manifest_path": announcement.manifest_path,
           "manifest_sha256": announcement.manifest_sha256}
    if announcement.out_root is not None:
        doc[ANNOUNCEMENT_OUT_ROOT] = announcement.out_root
    return compact_json(doc, allow_nan=False)


def parse_announcement(value: bytes | None) -> ShardAnnouncement | None:
    """The announcement a rollout.shards value holds, or None for any other record (not ours to judge)."""
    try:
        doc = json.loads(value) if value else None
    except (UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(doc, dict) and isinstance(doc.get("seq"), int) and isinstance(doc.get("shards"), list)
            and all(isinstance(doc.get(k), str) for k in ANNOUNCEMENT_PLACE)):
        return None
    out_root = doc.get(ANNOUNCEMENT_OUT_ROOT)
    manifest = {k: v for k, v in doc.items() if k not in ANNOUNCEMENT_PLACE and k != ANNOUNCEMENT_OUT_ROOT}
    return ShardAnnouncement(manifest, doc["dir"], doc["manifest_path"], doc["manifest_sha256"],
                             out_root if isinstance(out_root, str) else None)
