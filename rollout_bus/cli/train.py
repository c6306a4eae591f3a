"""``rollout-bus train`` and ``rollout-bus train-sim``: one trainer command, run with the real policy's step or
the stand-in's; thin: parse, settle, run.

Also ``python -m rollout_bus.cli.train`` (and ``python -m rollout_bus.cli.train_sim``). Either follows
rollout.shards for the given DP ranks, logs one ``trained seq=`` line per batch, shows progress on stderr,
checkpoints atomically to ``--checkpoint-dir`` and resumes from there when restarted. Exit 0 at the run's end
(or after ``--max-batches``); 1 on a feed timeout, a bad shard or a checkpoint that does not fit, or a cluster
that does not answer within ``--timeout`` (said at once as one WARNING line); 2, in one line before anything is
written, on a ``--checkpoint-dir`` that is a file, read-only or unreadable, or a bad ``--topic-prefix``.

* ``train``: the real trainer (``rollout_bus.learn.trainer``): the generators' own policy, trained with
  decoupled PPO/TIS on support-restricted log-probs; every new version's checkpoint published on
  rollout.weights (version 0 first, on a fresh start); ``checkpoint.pt``, ``trained.jsonl``, ``weights/``.
* ``train-sim``: the stand-in (``rollout_bus.sim.trainer``): a tiny seeded policy with the GRPO loss on
  support-renormalised log-probs; ``checkpoint.pt`` + ``trained.jsonl``, every ``--checkpoint-every`` batches.

The flags both take are declared once below; each command's signature adds its own step's flags.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from rollout_bus.cli import options
from rollout_bus.errors import ConfigError, RolloutBusError
from rollout_bus.kafka.admin import wait_for_cluster
from rollout_bus.config import GenerateSettings

console = Console(stderr=True)

RANKS = typer.Option("all", "--ranks", help="DP ranks this trainer trains: 'all' or e.g. 0,1.")
SHARDS_ROOT = typer.Option(None, "--shards-root",
                           help="Where the batch directories are mounted (default: as announced).")
LR_HELP = "Adam learning rate."
TIMEOUT = typer.Option(600.0, "--timeout", help="Fail after waiting this long for a batch.")
MAX_BATCHES = typer.Option(None, "--max-batches", min=0,
                           help="Stop once this many batches are trained (resumed ones included).")
START_SEQ = typer.Option(None, "--start-seq", min=0, help="A fresh trainer's first batch seq (default: the lowest seq "
                         "rollout.shards holds when it starts; 0 for a trainer started with the run, so a batch 1 "
                         "written before batch 0 does not start it past 0). A checkpoint resumes where it says.")
TORCH_THREADS = typer.Option(1, "--torch-threads", min=0, help="torch CPU threads (0: torch's default).")
VERBOSE = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level.")


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


def run_command(name: str, load: Callable[[], tuple[Callable[..., Any], Callable[..., Any]]], *,
                bootstrap_servers: str | None, topic_prefix: str | None, ranks: str, dp_size: int, verbose: bool,
                show_weights: bool = False, **step: Any) -> None:
    """What both commands do around their trainer: logging, the connection, the ranks, the opening line, a
    progress line while it trains, the summary, and exit 1 on the project's errors. ``load`` gives the trainer
    and its options class; it is called once the cluster answered (its imports, torch, take seconds)."""
    options.configure_logging(verbose)
    kafka = options.kafka_settings(bootstrap_servers, topic_prefix)
    options.writable_dir(step.get("checkpoint_dir"), "--checkpoint-dir")  # before a record or a file is written
    rank_list = parse_ranks(ranks, dp_size)
    weights = f", weights -> {kafka.topics().weights}" if show_weights else ""
    console.print(f"{name}: {kafka.topics().shards} ranks={','.join(map(str, rank_list))} "
                  f"dp_size={dp_size} -> {step['checkpoint_dir']}{weights}", soft_wrap=True)

    try:  # a closed port: one WARNING line at once, then the wait for a batch's --timeout
        wait_for_cluster(kafka.client_kwargs(), step["timeout_s"])
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    run, make_options = load()
    connection = kafka.client_kwargs()
    try:
        run_options = make_options(bootstrap_servers=connection.pop("bootstrap_servers"), kafka=connection,
                                   topic_prefix=kafka.topic_prefix, ranks=rank_list, dp_size=dp_size, **step)
    except ConfigError as exc:  # a value no flag's range rules out (--temperature 0): one line, exit 2
        options.refuse(str(exc))

    def show(progress: Any) -> None:
        loss = "" if progress.loss is None else f", loss {progress.loss:.5f}"
        reward = "" if progress.reward is None else f", reward {progress.reward:.3f}"
        status.update(f"{name}: {progress.batches} batches trained (last seq {progress.last_seq}{loss}{reward})")

    try:
        with console.status(f"{name}: waiting for the first batch") as status:
            result = run(run_options, on_progress=show)
    except RolloutBusError as exc:
        options.say_error(exc)
        raise typer.Exit(1) from exc
    console.print(result.summary(), soft_wrap=True)


def _learn_trainer() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from rollout_bus.learn.trainer import LearnOptions, run_learn  # torch and transformers: only here

    return run_learn, LearnOptions


def _sim_trainer() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from rollout_bus.sim.trainer import TrainSimOptions, run_train_sim  # torch: only here

    return run_train_sim, TrainSimOptions


def train(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    ranks: str = RANKS,
    dp_size: int = options.DP_SIZE,
    shards_root: Path | None = SHARDS_ROOT,
    checkpoint_dir: Path = typer.Option(Path("train"), "--checkpoint-dir",
                                        help="checkpoint.pt, trained.jsonl and weights/; resumed from when present."),
    seed: int = typer.Option(0, "--seed", help="Seeds the policy's initial weights (version 0)."),
    lr: float = typer.Option(3e-3, "--lr", min=0.0, help=LR_HELP),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0,
                                      help="The generators' sampling temperature (their log-probs are of logits/T)."),
    timeout: float = TIMEOUT,
    max_batches: int | None = MAX_BATCHES,
    start_seq: int | None = START_SEQ,
    torch_threads: int = TORCH_THREADS,
    device: str | None = typer.Option(None, "--device", help="torch device (default: cuda when present, else cpu)."),
    verbose: bool = VERBOSE,
) -> None:
    """Train the generators' policy on the announced shards of every given rank, shipping each new version."""
    run_command("train", _learn_trainer, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix,
                ranks=ranks, dp_size=dp_size, verbose=verbose, show_weights=True, shards_root=shards_root,
                checkpoint_dir=checkpoint_dir, seed=seed, lr=lr, temperature=temperature, timeout_s=timeout,
                max_batches=max_batches, start_seq=start_seq, torch_threads=torch_threads, device=device)


def train_sim(
    bootstrap_servers: str | None = options.BOOTSTRAP,
    topic_prefix: str | None = options.TOPIC_PREFIX,
    ranks: str = RANKS,
    dp_size: int = options.DP_SIZE,
    shards_root: Path | None = SHARDS_ROOT,
    checkpoint_dir: Path = typer.Option(Path("train-sim"), "--checkpoint-dir",
                                        help="checkpoint.pt and trained.jsonl; resumed from when present."),
    checkpoint_every: int = typer.Option(2, "--checkpoint-every", min=1, help="Checkpoint every N batches."),
    seed: int = typer.Option(0, "--seed", help="Seeds the policy's initial weights."),
    lr: float = typer.Option(1e-3, "--lr", min=0.0, help=LR_HELP),
    dim: int = typer.Option(16, "--dim", min=1, help="Embedding width of the tiny policy."),
    vocab_size: int = typer.Option(GenerateSettings.model_fields["vocab_size"].default, "--vocab-size", min=2,
                                   help="The generator's vocabulary size (shards do not record it)."),
    timeout: float = TIMEOUT,
    max_batches: int | None = MAX_BATCHES,
    step_delay: float = typer.Option(0.0, "--step-delay", min=0.0, help="Pause after each step (drills, demos)."),
    start_seq: int | None = START_SEQ,
    torch_threads: int = TORCH_THREADS,
    verbose: bool = VERBOSE,
) -> None:
    """Train a tiny policy on the announced shards of every given rank, checkpointing as it goes."""
    run_command("train-sim", _sim_trainer, bootstrap_servers=bootstrap_servers,
                topic_prefix=topic_prefix, ranks=ranks, dp_size=dp_size, verbose=verbose, shards_root=shards_root,
                checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, seed=seed, lr=lr, dim=dim,
                vocab_size=vocab_size, timeout_s=timeout, max_batches=max_batches, step_delay_s=step_delay,
                start_seq=start_seq, torch_threads=torch_threads)



if __name__ == "__main__":
    typer.run(train)
