"""Re-running the shard writer's batching over replayed episodes, and comparing each batch with its original.

Why a module of its own: batches are formed by the writer's own ``Batcher`` and decided and written by
its own ``decide`` step, then each written batch is compared shard by shard (sha256) with the manifest
of the same seq; the statuses are those of ``rollout_bus.replay.rerun``'s contract.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout_bus.consumers.shard_writer.batcher import Batcher, Outcome
from rollout_bus.consumers.shard_writer.batch import Batch
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.consumers.shard_writer.episodes import Episode, Member
from rollout_bus.consumers.shard_writer.decide import Decision, Verdict, decide, write_decided
from rollout_bus.wire.dead_letter import DlqStage, source_of
from rollout_bus.errors import ContractError
from rollout_bus.replay.report import BatchReport, Rejection
from rollout_bus.replay.settings import ReplaySettings

logger = logging.getLogger(__name__)


def _keys(manifest: Mapping[str, Any]) -> set[tuple[str, int]]:
    return {(e["key"], int(e["attempt"])) for e in (manifest.get("extra") or {}).get("episodes", [])}


def _outside(mine: set[tuple[str, int]], theirs: set[tuple[str, int]]) -> bool:
    """The manifest holds more, or later attempts, of what was replayed: the rest lies outside the range."""
    have, want = dict(mine), dict(theirs)
    return mine != theirs and all(k in want and a <= want[k] for k, a in have.items())


class _Rebuilder:
    def __init__(self, out_dir: Path, settings: ReplaySettings, manifests: Mapping[int, dict[str, Any]],
                 topic: str, write_partial: bool) -> None:
        self.out_dir, self.settings, self.manifests = out_dir, settings, manifests
        self.topic, self.write_partial = topic, write_partial
        self.reports: list[BatchReport] = []

    def batch(self, batch: Batch, *, leftover: bool) -> None:
        s = self.settings  # the writer's decision, with the staleness bound its manifests record
        decision = decide(batch, dp_size=s.dp_size, normalization=s.normalization, batching=s.batching,
                          max_staleness=s.max_staleness)
        batch = decision.batch
        if decision.verdict is Verdict.EMPTY:  # every group abandoned (or stale): the writer writes none either
            logger.info("batch=%d: every episode abandoned or stale (abandoned=%d, stale=%d): not written",
                        batch.seq, len(batch.abandoned), len(batch.stale))
            return
        expected = self.manifests.get(batch.seq)
        mine = {(e.key, e.attempt) for e in batch.episodes}
        theirs = _keys(expected) if expected is not None else None
        report = BatchReport(batch.seq, "written", len(mine), None if theirs is None else len(theirs))
        if theirs is not None and _outside(mine, theirs) and not self.write_partial:
            report.status, report.detail = "incomplete", f"{len(theirs - mine)} of its episodes are outside the range"
        elif theirs is None and leftover and not self.write_partial:
            report.status, report.detail = "incomplete", "partial batch with no manifest to compare: not written"
        else:
            self._write(decision, report, expected, mine, theirs)
        self.reports.append(report)

    def _write(self, decision: Decision, report: BatchReport, expected: Mapping[str, Any] | None,
               mine: set, theirs: set | None) -> None:
        error, manifest = decision.error, None
        if decision.verdict is Verdict.WRITE:
            try:
                manifest = write_decided(self.out_dir, decision, topic=self.topic)
            except ContractError as exc:  # a check of the write step itself: refused all the same
                error = exc
        if manifest is None:
            report.status, report.detail = "dead-lettered", f"the whole-batch check refuses it: {error}"
            return
        report.shards = {e["path"]: e["sha256"] for e in manifest["shards"]}
        if expected is None:
            return
        original = {e["path"]: e["sha256"] for e in expected.get("shards", [])}
        if mine != theirs:
            report.status = "differs"
            report.detail = f"episodes differ: {len(mine - theirs)} not in the manifest, {len(theirs - mine)} missing"
        elif original != report.shards:
            report.status = "differs"
            report.detail = "sha256 differs for " + ", ".join(sorted(p for p in set(original) | set(report.shards)
                                                                      if original.get(p) != report.shards.get(p)))
        else:
            report.status = "identical"

    def finish(self) -> list[BatchReport]:
        seen = {r.seq for r in self.reports}
        for seq, manifest in sorted(self.manifests.items()):
            if seq not in seen:
                self.reports.append(BatchReport(seq, "not-in-range", 0, len(_keys(manifest))))
        return sorted(self.reports, key=lambda r: r.seq)


def rebuild(episodes: Iterable[Member], settings: ReplaySettings, out_dir: Path,
            manifests: Mapping[int, dict[str, Any]], *, topic: str, rejections: list[Rejection],
            write_partial: bool = False) -> tuple[list[BatchReport], dict[str, int], int]:
    """Batch the episodes (and abandoned records) as the writer does and write what may be written;
    (reports, counts, episodes accepted)."""
    batcher = Batcher(RunBatching(settings.groups_per_batch, settings.batching))
    rebuilder = _Rebuilder(out_dir, settings, manifests, topic, write_partial)
    accepted = 0
    for episode in episodes:
        result = batcher.add(episode)
        accepted += result.outcome is Outcome.ACCEPTED and isinstance(episode, Episode)
        if result.outcome is Outcome.REJECTED:
            rejections.append(Rejection(source_of(topic, episode.partition, episode.offset), DlqStage.SHARDS, result.kind,
                                        result.reason))
        for batch in batcher.ready():
            rebuilder.batch(batch, leftover=False)
    for batch in batcher.flush():
        rebuilder.batch(batch, leftover=True)
    return rebuilder.finish(), dict(batcher.counts), accepted
