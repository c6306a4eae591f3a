"""``rollout-bus train-sim``: a small simulated trainer on the shard feed; thin: parse, settle, run.

Also ``python -m rollout_bus.cli.train_sim``. It follows rollout.shards for the given DP ranks, trains
a tiny seeded policy with the GRPO loss on support-renormalised log-probs, logs one ``trained seq=``
line per batch, shows progress on stderr, checkpoints atomically to ``--checkpoint-dir``
(``checkpoint.pt`` + ``trained.jsonl``) and resumes from there when restarted. Exit 0 at the run's end
(or after ``--max-batches``); 1 on a feed timeout, a bad shard or a checkpoint that does not fit.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.errors import RolloutBusError
from rollout_bus.sim.trainer import DEFAULT_VOCAB_SIZE, TrainSimOptions, TrainSimProgress, run_train_sim

console = Console(stderr=True)


def parse_ranks(ranks: str, dp_size: int) -> list[int]:
    """``all`` (every rank of ``dp_size``) or a comma-separated list of ranks."""
    if ranks.strip().lower() == "all":
        return list(range(dp_size))
    try:
        parsed = [int(r) for r in ranks.split(",") if r.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"--ranks must be 'all' or comma-separated integers, not {ranks!r}") from exc
    if not parsed or len(set(parsed)) != len(parsed) or any(not 0 <= r < dp_size for r in parsed):
        raise typer.BadParameter(f"--ranks must name distinct ranks in [0, {dp_size}), not {ranks!r}")
    return parsed


def train_sim(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    ranks: str = typer.Option("all", "--ranks", help="DP ranks this trainer trains: 'all' or e.g. 0,1."),
    dp_size: int = typer.Option(2, "--dp-size", min=1, help="The shard writer's DP size."),
    shards_root: Path | None = typer.Option(None, "--shards-root",
                                            help="Where the batch directories are mounted (default: as announced)."),
    checkpoint_dir: Path = typer.Option(Path("train-sim"), "--checkpoint-dir",
                                        help="checkpoint.pt and trained.jsonl; resumed from when present."),
    checkpoint_every: int = typer.Option(2, "--checkpoint-every", min=1, help="Checkpoint every N batches."),
    seed: int = typer.Option(0, "--seed", help="Seeds the policy's initial weights."),
    lr: float = typer.Option(1e-3, "--lr", min=0.0, help="Adam learning rate."),
    dim: int = typer.Option(16, "--dim", min=1, help="Embedding width of the tiny policy."),
    vocab_size: int = typer.Option(DEFAULT_VOCAB_SIZE, "--vocab-size", min=2,
                                   help="The generator's vocabulary size (shards do not record it)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Fail after waiting this long for a batch."),
    max_batches: int | None = typer.Option(None, "--max-batches", min=0,
                                           help="Stop once this many batches are trained (resumed ones included)."),
    step_delay: float = typer.Option(0.0, "--step-delay", min=0.0, help="Pause after each step (drills, demos)."),
    torch_threads: int = typer.Option(1, "--torch-threads", min=0, help="torch CPU threads (0: torch's default)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Train a tiny policy on the announced shards of every given rank, checkpointing as it goes."""
    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    connection = kafka.client_kwargs()
    train_options = TrainSimOptions(
        bootstrap_servers=connection.pop("bootstrap_servers"), kafka=connection, topic_prefix=kafka.topic_prefix,
        ranks=parse_ranks(ranks, dp_size), dp_size=dp_size, shards_root=shards_root, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, seed=seed, lr=lr, dim=dim, vocab_size=vocab_size, timeout_s=timeout,
        max_batches=max_batches, step_delay_s=step_delay, torch_threads=torch_threads)
    console.print(f"train-sim: {kafka.topics().shards} ranks={','.join(map(str, train_options.ranks))} "
                  f"dp_size={dp_size} -> {checkpoint_dir}", soft_wrap=True)

    def show(progress: TrainSimProgress) -> None:
        loss = "" if progress.loss is None else f", loss {progress.loss:.5f}"
        status.update(f"train-sim: {progress.batches} batches trained (last seq {progress.last_seq}{loss})")

    try:
        with console.status("train-sim: waiting for the first batch") as status:
            result = run_train_sim(train_options, on_progress=show)
    except RolloutBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print(result.summary(), soft_wrap=True)


if __name__ == "__main__":
    typer.run(train_sim)
