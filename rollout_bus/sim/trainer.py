"""A small simulated trainer: the shard feed's consumer for the demo and the tests.

It trains a tiny seeded policy (an embedding of the previous token and a linear head over the
vocabulary) on every DP rank's shards as they are announced on rollout.shards, with the GRPO
surrogate of ``rollout_bus.model.trainer_math`` on log-probs renormalised over each token's sampling
support, and checkpoints atomically, so a trainer killed at any moment resumes where its last
checkpoint was and trains exactly the batches after it again.

Contract:

* ``run_train_sim(options, *, log=None, on_progress=None) -> TrainResult`` runs the trainer loop
  (``rollout_bus.consumers.feed.loop.run_training``) with this module's ``SimStep``: one
  ``rollout_bus.consumers.feed.trainer_feed.ShardFeed`` per rank of ``options.ranks``. Each step takes the next batch
  of every rank's feed (they must hold the same seq, else ``ContractError``), computes each rank's
  loss (``grpo_tis_loss`` of ``shard_support_log_probs`` when the shard has sampling masks, else of a
  full-vocabulary ``log_softmax``; advantages are each sample's ``rewards`` broadcast over its
  response tokens; the rollout log-probs are the shard's, or the new ones detached when it has
  none), back-propagates ``loss_rank / len(ranks)`` (a simulated all-reduce: the summed gradient)
  and takes one Adam step; then (``publish_weights``, on by default) it publishes weights version
  ``seq + 1`` on rollout.weights, which generators following the weights stamp their turns with
  and bound their staleness by. It logs one ``trained seq=...`` line per step and ends when the feeds
  reach the run's end, or once ``max_batches`` batches (counted over the whole training, resumed
  ones included) are trained.
* Checkpoints every ``checkpoint_every`` trained batches (counted from the start of training, so a
  resumed run checkpoints where an undisturbed one does) and at the end:
  ``checkpoint_dir/checkpoint.pt`` (``torch.save`` of model, optimizer, feed states by rank, the
  trained seqs, the per-rank history, the torch RNG state and the options that shape the model)
  then ``checkpoint_dir/trained.jsonl`` (one line per trained seq per rank with its loss, exactly
  the checkpointed history), each written to a fsync'd temporary file and renamed. On start an
  existing checkpoint is loaded (model, optimizer, feeds, RNG) and ``trained.jsonl`` rewritten from
  it; a checkpoint of another model shape, ranks, DP size or topic is a ``ConfigError``. Training is
  deterministic given the checkpoint, so a run killed between checkpoints and restarted ends with
  the same trained seqs and the same losses as an undisturbed one.
* A full disk is waited out (``rollout_bus.model.files.wait_for_disk``), one WARNING line every 10 s.
* The loop, the checkpoint, ``trained.jsonl`` and the run's reconciliation are ``rollout_bus.consumers.feed``'s
  (``loop``, ``training``), shared with the real trainer (``rollout_bus.learn.trainer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rollout_bus.consumers.feed.loop import (Checkpoint, FeedOptions, Publish, TrainProgress, TrainResult, run_training,
                                             step_over_ranks)
from rollout_bus.consumers.feed.trainer_feed import TrainBatch
from rollout_bus.consumers.feed.training import TrainState
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError, must_be
from rollout_bus.model.trainer_math import grpo_tis_loss, response_token_index, shard_support_log_probs

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = GenerateSettings.model_fields["vocab_size"].default
_MASK_IDS = "rollout_sampling_mask_ids"
_LOGGED_METRICS = ("episode_raw_reward", "response_len/mean")


@dataclass
class TrainSimOptions(FeedOptions):
    """What ``run_train_sim`` trains on and how (the feed, the pause after each step: ``FeedOptions``)."""

    checkpoint_every: int = 2
    seed: int = 0
    lr: float = 1e-3
    dim: int = 16
    vocab_size: int = DEFAULT_VOCAB_SIZE  # the generator's; shards do not record it
    publish_weights: bool = True  # after training batch k, version k + 1 goes to rollout.weights

    def check(self) -> None:
        super().check()
        if self.checkpoint_every < 1:
            raise ConfigError(must_be("checkpoint_every", ">= 1", self.checkpoint_every))
        if self.vocab_size < 2 or self.dim < 1:
            raise ConfigError(must_be("vocab_size, dim", ">= 2, >= 1", (self.vocab_size, self.dim)))

    def shape(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed with these options."""
        return {"vocab_size": self.vocab_size, "dim": self.dim, "ranks": list(self.ranks), "dp_size": self.dp_size,
                "seed": self.seed}


# ---------------------------------------------------------------------------- the policy and its loss


class TinyPolicy(nn.Module):
    """Logits of the next token from the previous one: ``Linear(Embedding(prev))``, ``[R, V]``."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(prev_tokens))


def build_policy(vocab_size: int, dim: int, seed: int) -> TinyPolicy:
    """The policy fixed by ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyPolicy(vocab_size, dim)


def previous_tokens(tensors: Mapping[str, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """The token before each response token (0 for a response that starts its sample)."""
    tokens = tensors["tokens"].to(torch.int64)
    lengths = tensors["response_lengths"].to(torch.int64)
    sample_start = torch.repeat_interleave(tensors["tokens_offsets"][:-1].to(torch.int64), lengths,
                                           output_size=index.numel())
    before = tokens[(index - 1).clamp(min=0)]
    return torch.where(index > sample_start, before, torch.zeros_like(before))


def rank_loss(policy: TinyPolicy, tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """One rank's GRPO loss on its shard (vectorised over the response tokens) and its stats."""
    index = response_token_index(tensors)
    tokens = tensors["tokens"].to(torch.int64)
    vocab = policy.head.out_features
    if tokens.numel() and int(tokens.max()) >= vocab:
        raise ConfigError(must_be("vocab_size", f"> every token id (max {int(tokens.max())})", vocab))
    logits = policy(previous_tokens(tensors, index))
    if _MASK_IDS in tensors:
        new = shard_support_log_probs(logits, tensors)
    else:
        new = logits.log_softmax(-1).gather(1, tokens[index].unsqueeze(1)).squeeze(1)
    rollout = tensors.get("rollout_log_probs")
    rollout = new.detach() if rollout is None else rollout.to(new.dtype)
    lengths = tensors["response_lengths"].to(torch.int64)
    advantages = torch.repeat_interleave(tensors["rewards"].to(new.dtype), lengths, output_size=index.numel())
    return grpo_tis_loss(new, rollout, advantages, tensors["loss_masks"])


# ---------------------------------------------------------------------------- the step


def train_step(state: TrainState, batches: list[TrainBatch]) -> list[dict[str, Any]]:
    """One optimizer step over every rank's shard of one batch; a history row per rank."""
    def one_rank(batch: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, stats = rank_loss(state.policy, batch.tensors)
        return loss, {"seq": batch.seq, "rank": batch.rank, "samples": len(batch), **stats}

    return step_over_ranks(state, batches, one_rank)


def _step_line(seq: int, rows: list[dict[str, Any]], metrics: Mapping[str, Any]) -> str:
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("loss", "mean_abs_log_ratio", "clip_fraction")}
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in _LOGGED_METRICS if isinstance(metrics.get(k), (int, float)))
    return (f"trained seq={seq} ranks={','.join(str(r['rank']) for r in rows)} loss={mean['loss']:.6f} "
            f"mean_abs_log_ratio={mean['mean_abs_log_ratio']:.4f} clip_fraction={mean['clip_fraction']:.3f} "
            f"samples={sum(r['samples'] for r in rows)} {shown}").rstrip()


class SimStep:
    """The stand-in's part of the loop: the tiny policy's update, version ``seq + 1`` announced after it (no
    weights to fetch: generators only stamp and bound by it), a checkpoint every ``checkpoint_every`` batches,
    logged after the batch's line, and one at the end."""

    name = "train-sim"
    version = None  # its versions are stamps, not told in the summary

    def __init__(self, options: TrainSimOptions) -> None:
        self.options = options
        policy = build_policy(options.vocab_size, options.dim, options.seed)
        self.state = TrainState(policy, torch.optim.Adam(policy.parameters(), lr=options.lr))

    def shape(self) -> dict[str, Any]:
        return self.options.shape()

    def start(self, resumed: bool, next_seq: int | None, publish: Publish, log: logging.Logger) -> str:
        return f"next_seq={next_seq}"

    def train(self, batches: list[TrainBatch]) -> list[dict[str, Any]]:
        return train_step(self.state, batches)

    def ship(self, seq: int, publish: Publish) -> None:
        if self.options.publish_weights:
            publish(seq + 1, seq)

    def commit(self, seq: int, rows: list[dict[str, Any]], metrics: Mapping[str, Any], checkpoint: Checkpoint,
               log: logging.Logger) -> None:
        log.info(_step_line(seq, rows, metrics))
        if len(self.state.trained) % self.options.checkpoint_every == 0:
            checkpoint.save("the checkpoint")
            log.info("checkpoint batches=%d last_seq=%d path=%s", checkpoint.held, seq, checkpoint.path)

    def finish(self, checkpoint: Checkpoint, log: logging.Logger) -> None:
        trained = self.state.trained
        if checkpoint.held != len(trained):
            checkpoint.save("the checkpoint")
            log.info("checkpoint batches=%d last_seq=%s path=%s (end)", len(trained),
                     trained[-1] if trained else None, checkpoint.path)


def run_train_sim(options: TrainSimOptions, *, log: logging.Logger | None = None,
                  on_progress: Callable[[TrainProgress], None] | None = None) -> TrainResult:
    """Train on the feeds until the run's end (or ``max_batches``); see the module docstring."""
    return run_training(options, SimStep, log=log or logger, on_progress=on_progress)
