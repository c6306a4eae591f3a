"""What rollout.metrics and rollout.shards are told of the batches the shard writer decided, and in which order.

Why a module of its own: the order is the contract readers rely on (WIRE.md 6.2): every written batch's
metrics record is confirmed before any announcement, so an announcement on rollout.shards implies its
batch metrics; then the announcements and skips go out in seq order, confirmed, before the writer
commits past them (``rollout_bus.consumers.shard_writer.writer``). One call says a whole turn of the loop:
two round trips, not two per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.consumers.shard_writer.delivery import Outbox, Outgoing
from rollout_bus.consumers.shard_writer.out_dir import announcement, manifest_place
from rollout_bus.wire.control_records import BatchSkipped
from rollout_bus.wire.metrics_records import batch_metrics_record
from rollout_bus.wire.topics import Topics

__all__ = ["Said", "say"]


@dataclass(frozen=True)
class Said:
    """What rollout.metrics and rollout.shards are told of one decided batch: written (seq, manifest, its
    directory) with its flow metrics (``rollout_bus.consumers.shard_writer.flow``; none for a batch found on disk), or
    skipped (a seq that will never be written)."""

    written: tuple[int, dict[str, Any], Path] | None = None
    skipped: BatchSkipped | None = None
    flow: dict[str, float] | None = None


def say(outbox: Outbox, topics: Topics, said: list[Said]) -> None:
    """Every written batch's metrics record, confirmed; then, in seq order, each batch's announcement or
    skip, confirmed: an announcement on rollout.shards implies its batch metrics (WIRE.md 6.2)."""
    for item in said:
        if item.written is not None:
            seq, manifest, directory = item.written
            value = batch_metrics_record(seq, manifest["metrics"] | (item.flow or {}),
                                         samples=int(manifest["num_samples"]),
                                         manifest_path=manifest_place(Path(directory)))
            outbox.send(Outgoing(topics.metrics, str(seq).encode(), value, [], f"batch {seq} metrics"))
    outbox.confirm()
    for item in said:
        if item.written is not None:
            seq, manifest, directory = item.written
            outbox.send(Outgoing(topics.shards, str(seq).encode(), announcement(manifest, Path(directory)), [],
                                 f"batch {seq} manifest"))
        elif item.skipped is not None:
            skipped = item.skipped
            outbox.send(Outgoing(topics.shards, skipped.key(), skipped.value(), skipped.headers(),
                                 f"batch {skipped.seq} skipped"))
    outbox.confirm()
