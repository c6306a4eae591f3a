"""``rollout-bus shards``: the shard writer (rollout.episodes -> trainer shards), thin: parse, settle, run.

Also ``python -m rollout_bus.cli.shards``. Progress goes to stderr with rich; exit 0 when the
writer stops as asked (``--exit-when-idle``, ``--max-batches``, SIGTERM).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from consumers.shard_writer import ShardWriter, WriterOptions, WriterStats
from rollout_bus.cli import options
from rollout_bus.config import ShardSettings

console = Console(stderr=True)


def _progress_line(stats: WriterStats) -> str:
    return (f"shards: {stats.batches_written} batches written (last {stats.last_batch}), "
            f"{stats.episodes} episodes read, {stats.pending} pending, {stats.duplicates} duplicates, "
            f"{stats.dead_letters} dead letters")


def shards(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    out: Path | None = typer.Option(None, "--out", help="Directory for batch-*/dp-*.safetensors + manifest.json."),
    dp_size: int | None = typer.Option(None, "--dp-size", help="Data-parallel ranks: one shard each per batch."),
    groups_per_batch: int | None = typer.Option(None, "--groups-per-batch", help="Prompt groups per batch."),
    batching: str | None = typer.Option(None, "--batching",
                                        help="step: batch k = groups [k*G, (k+1)*G), replayable; "
                                             "arrival: the first G groups to complete."),
    group_id: str | None = typer.Option(None, "--group-id", help="Consumer group holding the committed offsets."),
    normalization: str | None = typer.Option(None, "--normalization", help="Rewards: none, grpo or grpo_std."),
    idle_flush_s: float | None = typer.Option(None, "--idle-flush-s",
                                              help="Write pending episodes as partial batches after this many "
                                                   "seconds without a new episode."),
    exit_when_idle: bool = typer.Option(False, "--exit-when-idle", help="Exit 0 once idle (after any flush)."),
    max_batches: int | None = typer.Option(None, "--max-batches", help="Exit 0 after writing this many batches."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Read finished episodes, form batches, write DP shards, announce them, then commit."""
    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    settings = options.role_settings(
        ShardSettings, out=str(out) if out is not None else None, dp_size=dp_size, groups_per_batch=groups_per_batch,
        batching=batching, group_id=group_id, normalization=normalization, idle_flush_s=idle_flush_s,
        exit_when_idle=exit_when_idle or None, max_batches=max_batches)
    writer_options = WriterOptions(
        out_dir=Path(settings.out), dp_size=settings.dp_size, groups_per_batch=settings.groups_per_batch,
        batching=settings.batching, group_id=settings.group_id, normalization=settings.normalization,
        idle_flush_s=settings.idle_flush_s, exit_when_idle=settings.exit_when_idle, max_batches=settings.max_batches,
    )
    console.print(f"shard writer: {kafka.topics().episodes} -> {writer_options.out_dir} "
                  f"(dp_size={settings.dp_size}, groups_per_batch={settings.groups_per_batch}, "
                  f"batching={settings.batching})")
    with console.status("shards: starting") as status:
        writer = ShardWriter(kafka.client_kwargs(), kafka.topics(), writer_options,
                             on_progress=lambda stats: status.update(_progress_line(stats)))
        try:
            stats = writer.run()
        except KeyboardInterrupt:
            stats = writer.stats
    console.print(_progress_line(stats))
    if stats.batches_found:
        console.print(f"found {stats.batches_found} complete batches on disk "
                      f"({stats.batches_reannounced} announced now)")


if __name__ == "__main__":
    typer.run(shards)
