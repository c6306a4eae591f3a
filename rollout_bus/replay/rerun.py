"""Rebuild trainer shards from an offset range of rollout.episodes or rollout.turns, and say what differs.

Contract:

* ``replay(client_kwargs, starts, out_dir=..., ...)`` reads the ranges with its own consumer
  (``kafka.reader.open_reader``: no group, no commits, nothing published) up to the end offsets at
  start (``to``: exclusive, for every range), and rebuilds batches into ``out_dir`` with the shard
  writer's own code: ``rollout_bus.consumers.shard_writer.batcher`` forms the batches, and
  ``rollout_bus.consumers.shard_writer.decide`` is the writer's own decision (its staleness net, with the
  ``max_staleness`` its manifests record in step batching; the empty batch; the conversion with the
  whole-batch check; the DP split) and write step.
  All ranges must be of one topic, ``rollout.episodes`` or ``rollout.turns`` (prefixed or not).
* From rollout.turns, episodes are first re-merged offline by the stream stage's own per-record
  logic (``rollout_bus.streams.processor.TurnProcessor`` over an in-memory table: the same duplicate,
  attempt, gap and merge rules, ``share_final_reward``); what it would have dead-lettered is
  reported, and episodes whose final turn lies outside the range are counted as open.
* The original manifests come from ``compare_dir`` (a shards directory, only read) when given,
  else from the announcements on the run's rollout.shards (same prefix as the source topic).
  Unset settings (batching, dp_size, groups_per_batch, normalization) are read from them
  (``groups_per_batch`` inferred from a full batch's groups), else the shard writer's defaults;
  ``ReplaySettings.sources`` says where each came from, and a flag that disagrees is warned about.
* Records are parsed as the writer parses them (``rollout_bus.consumers.shard_writer.episodes.parse_record``): episodes
  and ``abandoned`` records go to the batcher (an abandoned record completes its group, as in the
  writer, and the rebuilt manifest lists it); end-of-run markers are skipped, the leftovers being
  flushed at the end of the range anyway. A batch whose groups are all abandoned is not written
  (the writer writes none either) and gets no report.
* A batch is written when it is complete (``Batcher.ready``) or, for the leftovers that
  ``Batcher.flush`` returns at the end, when its episodes are exactly a manifest's episodes (the
  original was partial too) or ``write_partial`` is set. A batch holding only part of a
  manifest's episodes, or older attempts of them, is "incomplete" (not wholly inside the range)
  and is not written unless ``write_partial``. Each
  written batch is compared shard by shard (sha256) with its manifest of the same seq:
  ``identical`` / ``differs``; ``written`` when there is no manifest; ``dead-lettered`` when the
  whole-batch check refuses it (as the writer does); manifests no replayed episode touched are
  ``not-in-range``. In step mode batch contents are a function of the episodes alone, so a
  rebuilt batch is byte-identical to the original; arrival-mode seqs depend on read order and
  are compared as they come.
* ``out_dir`` must hold no batch yet and must not be ``compare_dir``.
* This module reads the ranges and puts the replay together; its parts are
  ``rollout_bus.replay.settings`` (the original manifests and settings), ``rollout_bus.replay.episodes``
  (records to episodes, the offline merge), ``rollout_bus.replay.rebuild`` (batching, writing,
  comparing) and ``rollout_bus.replay.report``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_bus.errors import ConfigError, MissingTopicError, must_be
from rollout_bus.kafka.clients import wait_for_partitions
from rollout_bus.kafka.reader import open_reader, read_ranges, resolve_ranges
from rollout_bus.wire.positions import RangeStart, topic_kind, topic_prefix
from rollout_bus.wire.topics import Topics
from rollout_bus.replay.episodes import TurnMerger, episodes_from_episode_records
from rollout_bus.replay.rebuild import rebuild
from rollout_bus.replay.report import Rejection, ReplayReport
from rollout_bus.replay.settings import manifests_from_announcements, manifests_in_dir, settle_settings

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (records read, records in the ranges)


def _check_out_dir(out_dir: Path, compare_dir: Path | None) -> None:
    if compare_dir is not None and out_dir.resolve() == compare_dir.resolve():
        raise ConfigError(must_be("--out", "a directory other than --compare", str(out_dir)))
    if out_dir.exists() and any(p.name.startswith("batch-") for p in out_dir.iterdir()):
        raise ConfigError(must_be("--out", "a new or empty directory (it already holds batches)", str(out_dir)))
    out_dir.mkdir(parents=True, exist_ok=True)


def _source_topic(starts: Sequence[RangeStart]) -> tuple[str, str]:
    if not starts:
        raise ConfigError(must_be("--from", "given at least once", None))
    topics = sorted({s.topic for s in starts})
    if len(topics) != 1:
        raise ConfigError(must_be("--from", "ranges of one topic", topics))
    kind = topic_kind(topics[0])
    if kind not in ("episodes", "turns"):
        raise ConfigError(must_be("--from topic", "rollout.episodes or rollout.turns (optionally prefixed)",
                                  topics[0]))
    return topics[0], kind


def _announced(consumer: Any, topic: str) -> dict[int, dict[str, Any]]:
    try:
        wait_for_partitions(consumer, topic, timeout_s=1.0)
    except MissingTopicError:
        return {}
    ranges = resolve_ranges(consumer, [RangeStart(topic)])
    return manifests_from_announcements(r.value for r in read_ranges(consumer, ranges))


def replay(client_kwargs: dict[str, Any], starts: Sequence[RangeStart], *, out_dir: str | Path,
           to: int | None = None, flags: Mapping[str, Any] | None = None, compare_dir: str | Path | None = None,
           use_announcements: bool = True, write_partial: bool = False,
           progress: Progress | None = None) -> ReplayReport:
    """Read the ranges, rebuild their batches into ``out_dir`` and compare (see the module docstring)."""
    topic, kind = _source_topic(starts)
    out = Path(out_dir)
    compare = Path(compare_dir) if compare_dir is not None else None
    _check_out_dir(out, compare)
    consumer = open_reader(client_kwargs)
    try:
        ranges = resolve_ranges(consumer, starts, to)
        if compare is not None:
            manifests, manifests_from = manifests_in_dir(compare), str(compare)
        elif use_announcements:
            shards_topic = Topics(prefix=topic_prefix(topic)).shards
            manifests, manifests_from = _announced(consumer, shards_topic), shards_topic
        else:
            manifests, manifests_from = {}, None
        settings = settle_settings(flags or {}, manifests)
        total, read = sum(r.records for r in ranges), 0

        def counted(record: Any) -> None:
            nonlocal read
            read += 1
            if progress is not None:
                progress(read, total)

        rejections: list[Rejection] = []
        records = read_ranges(consumer, ranges, on_record=counted)
        merger = TurnMerger(topic) if kind == "turns" else None
        episodes = merger.episodes(records, rejections) if merger else episodes_from_episode_records(records, rejections)
        batches, counts, accepted = rebuild(episodes, settings, out, manifests, topic=topic, rejections=rejections,
                                            write_partial=write_partial)
    finally:
        consumer.close()
    report = ReplayReport(topic, kind, [str(r) for r in ranges], read, accepted, settings,
                          manifests_from if manifests else None, batches, rejections, counts,
                          merger.open_episodes() if merger else 0)
    logger.info("replayed topic=%s records=%d episodes=%d batches=%s", topic, read, accepted,
                dict(report.by_status()))
    return report
