"""The batch decision, one for the shard writer and replay: write a due batch, skip it as empty, or dead-letter it.

Why one: replay (``rollout_bus.replay.rebuild``) rebuilds batches to compare them byte for byte with the
writer's, so both must reach the same decision from the same batch; written twice, the two copies drift.

Contract:

* ``decide(batch, dp_size=, normalization=, batching=, max_staleness=None)`` is pure (no Kafka, no
  files, no logging) and returns a ``Decision``, in this order:

  1. the staleness net (``batch.split_stale``; ``max_staleness=None``: none) moves the episodes too
     stale for the batch to ``Batch.stale``; ``Decision.batch`` is the batch after it;
  2. a batch left with no episode (every group abandoned, or its episodes stale) is ``EMPTY``: not
     written, its seq absent from the output;
  3. else its samples are converted to trainer data, with the whole-batch sampling-mask check, and
     split across ``dp_size`` ranks (``out_dir.convert_batch``), ready to write (``WRITE``);
  4. a ``ContractError`` in 1 or 3 (the mask check: ``MaskCheckError``, or any other contract
     check) makes it ``DEAD_LETTER``: every episode of the batch goes to the DLQ, ``Decision.error``
     says why (after a failure in 1, the batch as formed, no episode stale).

* ``Decision.dead_letters()``: what goes to the DLQ, in order: each stale episode (kind ``stale``,
  ``StaleEpisode.reason``), then for ``DEAD_LETTER`` each episode of the batch (kind ``mask-check``
  or ``convert``, the error and the episode's batch positions). ``Decision.why`` is the reason a
  skipped batch gives on rollout.shards (``control_records.BatchSkipped``, whose ``why`` is the verdict).
* ``write_decided(out_dir, decision, topic=)`` writes a ``WRITE`` decision's shards and manifest
  (``out_dir.write_batch``: the manifest records the settings it was decided with) and returns the
  manifest. Whoever calls it sends, logs and counts; the decision itself is a function of the batch
  and the settings, so a restart or a replay with the same settings decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rollout_bus.errors import ContractError, MaskCheckError
from rollout_bus.consumers.shard_writer.batch import Batch, split_stale
from rollout_bus.consumers.shard_writer.episodes import Episode
from rollout_bus.consumers.shard_writer.out_dir import convert_batch, write_batch
from rollout_bus.wire.dead_letter import DlqKind


class Verdict(StrEnum):
    """What becomes of a due batch (the two skips spelt as ``control_records.BatchSkipped.why``)."""

    WRITE = "write"
    EMPTY = "empty"
    DEAD_LETTER = "dead-lettered"


@dataclass(frozen=True)
class DueLetter:
    """One episode the decision sends to the DLQ."""

    episode: Episode
    kind: str
    reason: str


@dataclass(frozen=True, eq=False)
class Decision:
    """A due batch's verdict, the batch as decided (stale episodes moved to ``stale``) and what it needs."""

    verdict: Verdict
    batch: Batch
    normalization: str
    batching: str
    max_staleness: int | None
    samples: list | None = None  # WRITE: the samples written (for the batch metrics)
    ranks: list[dict[str, Any]] | None = None  # WRITE: the trainer data of each rank
    error: ContractError | None = None  # DEAD_LETTER: why

    @property
    def kind(self) -> str | None:
        """The DLQ kind of a dead-lettered batch's episodes."""
        if self.error is None:
            return None
        return DlqKind.MASK_CHECK if isinstance(self.error, MaskCheckError) else DlqKind.CONVERT

    @property
    def emptied_by(self) -> str:
        """What left an empty batch without episodes."""
        return "abandoned or stale" if self.batch.stale else "abandoned"

    @property
    def why(self) -> str:
        """Why the batch is skipped ("" when written)."""
        batch = self.batch
        if self.verdict is Verdict.EMPTY:
            return (f"every episode of it was {self.emptied_by} ({len(batch.abandoned)} abandoned, "
                    f"{len(batch.stale)} stale episodes)")
        if self.verdict is Verdict.DEAD_LETTER:
            return f"{self.kind}: {self.error}"
        return ""

    def dead_letters(self) -> list[DueLetter]:
        """The stale episodes, then (``DEAD_LETTER``) every episode of the batch, each with its reason."""
        letters = [DueLetter(s.episode, DlqKind.STALE, s.reason) for s in self.batch.stale]
        if self.verdict is not Verdict.DEAD_LETTER:
            return letters
        batch, position = self.batch, 0
        for episode in batch.episodes:
            span = f"{position}..{position + len(episode.segments) - 1}"
            reason = (f"batch {batch.seq} ({len(batch.episodes)} episodes) failed the whole-batch check: "
                      f"{self.error}; this episode ({episode.key}, attempt {episode.attempt}) held batch "
                      f"positions {span}")
            letters.append(DueLetter(episode, self.kind, reason))
            position += len(episode.segments)
        return letters


def decide(batch: Batch, *, dp_size: int, normalization: str, batching: str,
           max_staleness: int | None = None) -> Decision:
    """Write, skip as empty, or dead-letter a due batch (see the module docstring)."""
    settings = {"normalization": normalization, "batching": batching, "max_staleness": max_staleness}
    try:
        batch = split_stale(batch, max_staleness)
        if batch.empty:
            return Decision(Verdict.EMPTY, batch, **settings)
        samples, ranks = convert_batch(batch, dp_size=dp_size, normalization=normalization)
    except ContractError as exc:
        return Decision(Verdict.DEAD_LETTER, batch, error=exc, **settings)
    return Decision(Verdict.WRITE, batch, samples=samples, ranks=ranks, **settings)


def write_decided(out_dir: Path, decision: Decision, *, topic: str) -> dict[str, Any]:
    """Write a ``WRITE`` decision's shards and manifest (atomic, sha256); the manifest."""
    return write_batch(out_dir, decision.batch, decision.samples, decision.ranks, topic=topic,
                       batching=decision.batching, normalization=decision.normalization,
                       max_staleness=decision.max_staleness)
