"""``rollout-bus shards``: the shard writer (rollout.episodes -> trainer shards), thin: parse, settle, run.

Also ``python -m rollout_bus.cli.shards``. Progress goes to stderr with rich; exit 0 when the
writer stops as asked (``--exit-on-end-of-run``, ``--exit-when-idle``, ``--max-batches``, SIGTERM).
Broker outages never end it: the writer waits, logging one line per retry. With ``--exit-on-end-of-run``,
a run whose end-of-run markers were deleted unread ends once every partition is read to its end, and the
writer exits 65 with one ERROR line naming every lost range (``shard_writer.lost_markers``). ``--max-staleness K``
(or ``ROLLOUT_BUS_MAX_STALENESS``, ``BatchingSettings.max_staleness``) turns on the staleness net of step
batching (``rollout_bus.consumers.shard_writer.staleness``); the progress line counts the episodes it dropped.
Before it reads anything, the writer declares its batching on rollout.run (or checks the run's):
a writer whose batching differs from the run's exits 2 naming the setting.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import typer
from rich.console import Console

from rollout_bus.consumers.shard_writer.lost_markers import EXIT_RECORDS_LOST, RecordsLostError
from rollout_bus.consumers.shard_writer.out_dir import check_out_dir
from rollout_bus.consumers.shard_writer.writer import ShardWriter
from rollout_bus.consumers.shard_writer.options import WriterOptions, WriterStats
from rollout_bus.cli import options
from rollout_bus.config import ShardSettings
from rollout_bus.errors import EXIT_PARTITIONS_CHANGED, ConfigError, PartitionsChangedError
from rollout_bus.kafka.admin import wait_for_cluster
from rollout_bus.kafka.run_record import check_run_batching, declared_by

console = Console(stderr=True)


def _progress_line(stats: WriterStats) -> str:
    return (f"shards: {stats.batches_written} batches written (last {stats.last_batch}), "
            f"{stats.episodes} episodes read ({stats.abandoned} abandoned), {stats.pending} pending, "
            f"{stats.duplicates} duplicates, {stats.dead_letters} dead letters"
            + (f", {stats.stale} stale" if stats.stale else "")
            + (f", lag {stats.lag}" if stats.lag is not None else "")
            + (f", {stats.runs_ended} runs ended" if stats.runs_ended else ""))


def _banner(episodes_topic: str, writer: WriterOptions) -> str:
    run = writer.run_batching
    return (f"shard writer: {episodes_topic} -> {writer.out_dir} (dp_size={writer.dp_size}, "
            f"groups_per_batch={run.groups_per_batch}, batching={run.batching}"
            + (f", max_staleness={run.max_staleness}" if run.max_staleness is not None else "") + ")")


def shards(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    out: Path | None = typer.Option(None, "--out", help="Directory for batch-*/dp-*.safetensors + manifest.json."),
    dp_size: int | None = options.DP_SIZE_SETTING,
    groups_per_batch: int | None = options.GROUPS_PER_BATCH,
    batching: str | None = options.BATCHING,
    group_id: str | None = typer.Option(None, "--group-id", help="Consumer group holding the committed offsets "
                                           "(after the topic prefix)."),
    normalization: str | None = typer.Option(None, "--normalization", help="Rewards: none, grpo or grpo_std."),
    exit_when_idle: bool = typer.Option(False, "--exit-when-idle",
                                        help="Exit 0 once caught up and idle (never writes a batch: pending "
                                             "episodes stay uncommitted for the next run)."),
    exit_on_end_of_run: bool = typer.Option(False, "--exit-on-end-of-run",
                                            help="Exit 0 once the run's end-of-run markers arrived and its last, "
                                                 "partial batch is written and committed; exit 65, naming "
                                                 "every lost range, when records deleted unread may have "
                                                 "held the markers and every partition is read to its end."),
    max_batches: int | None = typer.Option(None, "--max-batches", help="Exit 0 after writing this many batches."),
    max_staleness: int | None = options.MAX_STALENESS,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Read finished episodes, form batches, write DP shards, announce them, then commit."""
    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    settings = options.role_settings(
        ShardSettings, out=str(out) if out is not None else None, dp_size=dp_size, groups_per_batch=groups_per_batch,
        batching=batching, group_id=group_id, normalization=normalization, exit_when_idle=exit_when_idle or None,
        exit_on_end_of_run=exit_on_end_of_run or None, max_batches=max_batches, max_staleness=max_staleness)
    writer_options = options.plain_values(
        WriterOptions, settings, out_dir=Path(settings.out), run_batching=settings.run_batching(),
        group_id=kafka.topics().group(settings.group_id), max_record_bytes=kafka.max_record_bytes)
    try:  # a --out that is a file, read-only, another writer's or another run's: said before any topic or record
        check_out_dir(writer_options.out_dir, kafka.topics().episodes)
    except ConfigError as exc:
        options.refuse(f"shard writer refused: {exc}")
    console.print(_banner(kafka.topics().episodes, writer_options))
    wait_for_cluster(kafka.client_kwargs(), None)  # a bootstrap that never answers is said within seconds, and why
    try:
        check_run_batching(kafka.client_kwargs(), kafka.topics(), settings.run_batching(declared_by("shard writer")))
    except ConfigError as exc:
        options.refuse(f"shard writer refused: {exc}")
    stats = _write_shards(kafka, writer_options)
    console.print(_progress_line(stats))
    if stats.batches_found:
        console.print(f"found {stats.batches_found} complete batches on disk "
                      f"({stats.batches_reannounced} announced now)")


def _write_shards(kafka, writer_options: WriterOptions):
    """Run the writer until it stops; a refusal or a stage error becomes its exit code (one line each)."""
    log = logging.getLogger("rollout_bus.consumers.shard_writer")
    with console.status("shards: starting") as status:
        writer = ShardWriter(kafka.client_kwargs(), kafka.topics(), writer_options,
                             on_progress=lambda stats: status.update(_progress_line(stats)))
        # what imports built (torch: ~200k objects) lives as long as the process: frozen, a full
        # collection no longer scans it (a 76 ms pause, measured) between batches
        gc.freeze()
        try:
            return writer.run()
        except KeyboardInterrupt:
            return writer.stats
        except ConfigError as exc:  # another writer holds --out, or --out holds another run's batches
            options.refuse(f"shard writer refused: {exc}")
        except PartitionsChangedError as exc:
            log.error("%s", exc)
            raise typer.Exit(EXIT_PARTITIONS_CHANGED) from exc
        except RecordsLostError as exc:  # --exit-on-end-of-run: the run ended, its end-of-run markers lost
            console.print(_progress_line(writer.stats))
            log.error("%s", exc)
            raise typer.Exit(EXIT_RECORDS_LOST) from exc

if __name__ == "__main__":
    typer.run(shards)
