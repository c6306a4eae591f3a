"""``rollout-bus train``: the real trainer (the generators' own policy) on the shard feed; thin: parse, settle, run.

Also ``python -m rollout_bus.cli.train``. It follows rollout.shards for the given DP ranks, trains the
policy with decoupled PPO/TIS on support-restricted log-probs, publishes every new version's
checkpoint on rollout.weights (version 0 first, on a fresh start), logs one ``trained seq=`` line per
batch, shows progress on stderr, checkpoints atomically to ``--checkpoint-dir`` (``checkpoint.pt``,
``trained.jsonl``, ``weights/``) and resumes from there when restarted. Exit 0 at the run's end (or
after ``--max-batches``); 1 on a feed timeout, a bad shard or a checkpoint that does not fit.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.cli.train_sim import parse_ranks
from rollout_bus.errors import RolloutBusError

console = Console(stderr=True)


def train(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    ranks: str = typer.Option("all", "--ranks", help="DP ranks this trainer trains: 'all' or e.g. 0,1."),
    dp_size: int = typer.Option(2, "--dp-size", min=1, help="The shard writer's DP size."),
    shards_root: Path | None = typer.Option(None, "--shards-root",
                                            help="Where the batch directories are mounted (default: as announced)."),
    checkpoint_dir: Path = typer.Option(Path("train"), "--checkpoint-dir",
                                        help="checkpoint.pt, trained.jsonl and weights/; resumed from when present."),
    seed: int = typer.Option(0, "--seed", help="Seeds the policy's initial weights (version 0)."),
    lr: float = typer.Option(3e-3, "--lr", min=0.0, help="Adam learning rate."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0,
                                      help="The generators' sampling temperature (their log-probs are of logits/T)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Fail after waiting this long for a batch."),
    max_batches: int | None = typer.Option(None, "--max-batches", min=0,
                                           help="Stop once this many batches are trained (resumed ones included)."),
    torch_threads: int = typer.Option(1, "--torch-threads", min=0, help="torch CPU threads (0: torch's default)."),
    device: str | None = typer.Option(None, "--device", help="torch device (default: cuda when present, else cpu)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
) -> None:
    """Train the generators' policy on the announced shards of every given rank, shipping each new version."""
    from rollout_bus.learn.trainer import LearnOptions, LearnProgress, run_learn  # torch and transformers: only here

    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    connection = kafka.client_kwargs()
    learn_options = LearnOptions(
        bootstrap_servers=connection.pop("bootstrap_servers"), kafka=connection, topic_prefix=kafka.topic_prefix,
        ranks=parse_ranks(ranks, dp_size), dp_size=dp_size, shards_root=shards_root, checkpoint_dir=checkpoint_dir,
        seed=seed, lr=lr, temperature=temperature, timeout_s=timeout, max_batches=max_batches,
        torch_threads=torch_threads, device=device)
    console.print(f"train: {kafka.topics().shards} ranks={','.join(map(str, learn_options.ranks))} "
                  f"dp_size={dp_size} -> {checkpoint_dir}, weights -> {kafka.topics().weights}", soft_wrap=True)

    def show(progress: LearnProgress) -> None:
        loss = "" if progress.loss is None else f", loss {progress.loss:.5f}"
        reward = "" if progress.reward is None else f", reward {progress.reward:.3f}"
        status.update(f"train: {progress.batches} batches trained (last seq {progress.last_seq}{loss}{reward})")

    try:
        with console.status("train: waiting for the first batch") as status:
            result = run_learn(learn_options, on_progress=show)
    except RolloutBusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print(result.summary(), soft_wrap=True)


if __name__ == "__main__":
    typer.run(train)
