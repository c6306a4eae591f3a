"""The shard writer's output directory and announcements: what is already done, and what a batch says.

Contract:

* ``scan_out_dir(out_dir)`` returns every ``batch-*/`` whose manifest verifies (sha256 and size of
  every shard), in seq order, as ``WrittenBatch``. It also cleans up after a killed writer:
  temporary files (``.*.tmp``) are removed everywhere, and a batch directory without a manifest
  (or whose manifest does not verify) loses its shard files, since such a batch was never
  complete. The writer then writes it again; in step mode with the same episodes, byte for byte.
* ``manifest_extra(batch, ...)`` and ``batch_sources(batch, topic)`` build what the manifest holds
  beyond the shard list: the batching mode, the groups (with their ``episodes`` and ``abandoned``
  counts and ``complete``: a partial batch written by the end-of-run flush may hold incomplete
  groups), every episode with its rollout key, attempt and source offset, every abandoned episode
  (``abandoned``: key, attempt, kind, reason, source, and where its record was read), every
  episode the staleness net dropped (``stale``: ``rollout_bus.consumers.shard_writer.staleness.StaleEpisode.as_json``) and
  the bound it applied (``max_staleness``, null when none), the weight versions of the episodes
  written, and per partition the offset range the batch was read from (abandoned and stale
  records included). With the abandoned and stale episodes listed, a replay or a restart reaches
  the same decision from the log.
* ``check_out_dir(out_dir, episodes_topic)`` refuses, reading only, what the writer would refuse later (a
  directory it cannot write, another writer's, another run's batches: ``manifest_topics``), so the command
  says it before it creates a topic or writes a record.
* ``written_keys(out_dir, seq)`` reads back which rollout keys (and attempts) batch ``seq`` holds,
  as episode, abandoned or stale, from its manifest; None when the batch is not on disk (never written,
  dead-lettered, or every group of it abandoned). The writer's batcher looks up batches it no
  longer remembers with it.
* ``write_batch(...)`` (the one write step of writer and replay) writes the shards and the
  manifest; the manifest's ``metrics`` (``batch_metrics``) are ``compute_metrics_from_samples``
  plus ``compute_staleness_metrics`` with step = the batch seq, over the samples written (stale
  episodes left out).
* ``announcement(manifest, batch_dir)`` is the rollout.shards value: the manifest plus ``dir`` and
  ``manifest_path`` relative to the output root, ``manifest_sha256`` (of the manifest file's bytes)
  and ``out_root``. ``announced_ids(records)`` reads back which (batch name, manifest_sha256) pairs
  were announced (a moved output directory changes neither), so a
  restarted writer announces a batch it wrote but never announced, and no other.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.consumers.shard_writer.batch import Batch
from rollout_bus.consumers.shard_writer.episodes import GroupKey
from rollout_bus.consumers.shard_writer.writer_lock import WriterLockedError, held_by_another, unwritable
from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.model.sample import AdapterRef
from rollout_bus.model.metrics import compute_metrics_from_samples, compute_staleness_metrics
from rollout_bus.wire.shard_announcement import ShardAnnouncement, announcement_value, parse_announcement
from rollout_bus.model.train_data import convert_samples_to_train_data, split_train_data_by_dp
from rollout_bus.model.shards import MANIFEST_NAME, batch_path, read_manifest, verify_batch, write_batch_shards

logger = logging.getLogger(__name__)

BATCH_GLOB = "batch-*"
SHARD_GLOB = "dp-*.safetensors"


@dataclass(frozen=True)
class WrittenBatch:
    """A complete batch found on disk."""

    seq: int
    directory: Path
    manifest: dict[str, Any]
    manifest_sha256: str

    def episodes(self) -> list[tuple[str, int]]:
        return [(e["key"], int(e["attempt"])) for e in self.manifest.get("extra", {}).get("episodes", [])]

    def keys(self) -> list[tuple[str, int]]:
        """Every rollout key the batch decided on: its episodes, abandoned and stale episodes."""
        return _manifest_keys(self.manifest)

    def groups(self) -> list[GroupKey]:
        out = []
        for g in self.manifest.get("extra", {}).get("groups", []):
            adapter = None if g.get("adapter") is None else AdapterRef(g["adapter"], int(g["adapter_slot"]))
            out.append((adapter, int(g["group_index"])))
        return out


def _manifest_keys(manifest: dict[str, Any]) -> list[tuple[str, int]]:
    extra = manifest.get("extra") or {}
    decided = [*extra.get("episodes", []), *extra.get("abandoned", []), *extra.get("stale", [])]
    return [(e["key"], int(e["attempt"])) for e in decided]


def written_keys(out_dir: str | os.PathLike[str], seq: int) -> dict[str, int] | None:
    """{rollout key: attempt} of batch ``seq`` as its manifest lists them, or None when it is not on disk."""
    try:
        manifest = read_manifest(batch_path(out_dir, seq))
    except ContractError as exc:
        logger.warning("unreadable manifest of batch=%d: %s", seq, exc)
        return None
    return None if manifest is None else dict(_manifest_keys(manifest))


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _clear_incomplete(directory: Path, why: str) -> None:
    """Drop the files of a batch that never completed; its episodes are still uncommitted."""
    removed = 0
    for path in [*directory.glob(SHARD_GLOB), directory / MANIFEST_NAME]:
        if path.exists():
            path.unlink()
            removed += 1
    if removed:
        logger.warning("cleared incomplete batch dir=%s files=%d reason=%s", directory, removed, why)
    try:
        directory.rmdir()
    except OSError:
        pass  # something else lives there; leave it


def manifest_topics(manifest: dict[str, Any]) -> list[str]:
    """The topics a batch's episodes were read from, as its manifest's ``sources`` name them."""
    sources = manifest.get("sources")
    return sorted({s.get("topic") for s in sources if isinstance(s, dict)} if isinstance(sources, list) else ())


def check_out_dir(out_dir: str | os.PathLike[str], episodes_topic: str | None = None, flag: str = "--out") -> None:
    """Refuse, before anything is created or written, an output directory this process cannot write (a file,
    read-only, unreadable: ``ConfigError``), one another writer holds (``WriterLockedError``), or, given the
    writer's ``episodes_topic``, one holding batches read from another topic (another run's). Reads only."""
    problem = unwritable(out_dir, flag)
    if problem is not None:
        raise ConfigError(problem)
    held = held_by_another(out_dir)
    if held is not None:
        raise WriterLockedError(held)
    if episodes_topic is None:
        return
    for directory in sorted(p for p in Path(out_dir).glob(BATCH_GLOB) if p.is_dir()):
        try:
            topics = manifest_topics(read_manifest(directory) or {})
        except (ContractError, OSError):
            continue  # an unreadable manifest: the writer's scan clears that batch
        if topics and topics != [episodes_topic]:
            raise ConfigError(f"{flag} {out_dir} holds batches of another run: {directory.name}'s episodes came "
                              f"from {', '.join(topics)}, this writer reads {episodes_topic}; give this run an output "
                              "directory of its own")


def scan_out_dir(out_dir: str | os.PathLike[str]) -> list[WrittenBatch]:
    """Verified batches in ``out_dir``; cleans temporaries and incomplete batches (see module)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    found = []
    for directory in sorted(p for p in root.glob(BATCH_GLOB) if p.is_dir()):
        for path in directory.iterdir():
            if _is_temporary(path):
                path.unlink(missing_ok=True)
                logger.info("removed leftover temporary file path=%s", path)
        try:
            manifest = verify_batch(directory)
        except ContractError as exc:
            _clear_incomplete(directory, f"manifest does not verify: {exc}")
            continue
        if manifest is None:
            _clear_incomplete(directory, "no manifest")
            continue
        digest = hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()
        found.append(WrittenBatch(int(manifest["seq"]), directory, manifest, digest))
    return sorted(found, key=lambda b: b.seq)


def batch_sources(batch: Batch, topic: str) -> list[dict[str, Any]]:
    """Per source partition: the first and last offset this batch's episodes (and abandoned records) were read from."""
    by_partition: dict[int, list[int]] = {}
    for member in batch.members():
        by_partition.setdefault(member.partition, []).append(member.offset)
    return [{"topic": topic, "partition": p, "first_offset": min(o), "last_offset": max(o), "records": len(o)}
            for p, o in sorted(by_partition.items())]


def manifest_extra(batch: Batch, *, batching: str, normalization: str,
                   max_staleness: int | None = None) -> dict[str, Any]:
    """Everything a reader needs to trace the batch back to its episodes."""
    return {
        "batching": batching,
        "normalization": normalization,
        "partial": batch.partial,
        "incomplete_groups": sum(1 for g in batch.groups if not g.complete),
        "groups": [g.as_json() for g in batch.groups],
        "episodes": [{"key": e.key, "attempt": e.attempt, "partition": e.partition, "offset": e.offset,
                      "segments": len(e.segments)} for e in batch.episodes],
        "abandoned": [a.as_json() for a in batch.abandoned],
        "max_staleness": max_staleness,
        "stale": [s.as_json() for s in batch.stale],
        # the policy versions the batch's samples were generated with (a trainer's staleness check)
        "weight_versions": sorted({v for e in batch.episodes for s in e.segments for v in s.weight_versions}),
    }


def manifest_place(batch_dir: Path) -> str:
    """The manifest's path as announced: relative to the output root (``batch-00000003/manifest.json``)."""
    return f"{Path(batch_dir).name}/{MANIFEST_NAME}"


def announcement(manifest: dict[str, Any], batch_dir: Path) -> bytes:
    """The rollout.shards value for one batch (``shard_announcement.announcement_value``): its place relative to the
    output root, and the writer's absolute root as a hint."""
    batch_dir = Path(batch_dir).resolve()
    sha = hashlib.sha256((batch_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    return announcement_value(ShardAnnouncement(manifest, batch_dir.name, manifest_place(batch_dir), sha,
                                                str(batch_dir.parent)))


def announced_ids(values: Iterable[bytes | None]) -> set[tuple[str, str]]:
    """(batch directory name, manifest_sha256) of every announcement among rollout.shards record values."""
    found = (parse_announcement(value) for value in values)
    return {(a.batch_name, a.manifest_sha256) for a in found if a is not None}


def convert_batch(batch: Batch, *, dp_size: int, normalization: str) -> tuple[list, list[dict[str, Any]]]:
    """A batch's samples and its trainer data split across ranks; ContractError when the batch is refused
    (the whole-batch mask check, mismatched sibling rewards), before anything is written."""
    samples = batch.samples()
    data = convert_samples_to_train_data(samples, normalization=normalization)
    return samples, split_train_data_by_dp(data, dp_size)


def batch_metrics(samples: list, seq: int) -> dict[str, Any]:
    """The manifest's (and rollout.metrics') metrics: section 6's, plus staleness with step = the batch seq
    (the trainer trains the batches in seq order; in arrival mode too, where no net drops anything)."""
    return compute_metrics_from_samples(samples) | compute_staleness_metrics(samples, seq)


def write_batch(out_dir: Path, batch: Batch, samples: list, ranks: list[dict[str, Any]], *, topic: str,
                batching: str, normalization: str, max_staleness: int | None = None) -> dict[str, Any]:
    """Write a converted batch's shards and manifest (atomic, sha256); the one write step of writer and replay."""
    return write_batch_shards(out_dir, batch.seq, ranks, metrics=batch_metrics(samples, batch.seq),
                              sources=batch_sources(batch, topic),
                              extra=manifest_extra(batch, batching=batching, normalization=normalization,
                                                   max_staleness=max_staleness))
