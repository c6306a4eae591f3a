"""What the shard writer is told (``WriterOptions``, plain values from the CLI) and what it did (``WriterStats``).

Plain data, apart from the loop (``rollout_bus.consumers.shard_writer.writer``): the CLI builds the options (each
field from the shard writer's setting of the same name, ``cli.options.plain_values``; never ``rollout_bus.config``
here), and start-up recovery and the dead letters count into a ``WriterStats`` as the loop does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollout_bus.consumers.shard_writer.batcher import DEFAULT_WRITTEN_MEMORY
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.topics import DEFAULT_MAX_RECORD_BYTES

DEFAULT_IDLE_S = 10.0


@dataclass
class WriterStats:
    """What the writer did, for progress lines and the exit summary."""

    records: int = 0
    episodes: int = 0
    abandoned: int = 0
    stale: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    dead_letters_by_reference: int = 0
    control_records: int = 0
    batches_written: int = 0
    batches_dead_lettered: int = 0
    batches_skipped: int = 0
    batches_found: int = 0
    batches_reannounced: int = 0
    runs_ended: int = 0
    broker_waits: int = 0
    disk_waits: int = 0  # writes retried because the output's disk was full
    records_lost: int = 0  # rollout.episodes records deleted before they were read (dead-lettered as lost)
    incomplete_groups: int = 0  # groups the end-of-run flush wrote short (logged, manifest complete: false)
    pending: int = 0
    lag: int | None = None
    last_batch: int | None = None
    written_dirs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WriterOptions:
    """Plain values the CLI hands the writer."""

    out_dir: Path
    dp_size: int
    run_batching: RunBatching  # its mode and G; its max_staleness is the staleness net (step batching only)
    group_id: str = "rollout-bus-shards"
    normalization: str = "grpo"
    exit_when_idle: bool = False
    exit_on_end_of_run: bool = False
    max_batches: int | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    written_memory: int = DEFAULT_WRITTEN_MEMORY
    idle_s: float = DEFAULT_IDLE_S
