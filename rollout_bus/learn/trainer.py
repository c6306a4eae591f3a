"""The real trainer: the generators' own policy, trained on what the bus delivers, shipped back as checkpoints.

It runs the trainer loop the stand-in (``rollout_bus.sim.trainer``) runs (``rollout_bus.consumers.feed.loop``:
every DP rank's shard feed, the exactly-once checkpoint of ``rollout_bus.consumers.feed.training``) with its own
step, ``LearnStep``: what it trains is the ``LlamaForCausalLM``
the generators sample from, and after every step it writes that policy's weights as a verified
checkpoint and publishes where they are on rollout.weights, so the generators' next tokens come from
the weights this step made.

Each rank's loss is decoupled PPO with truncated importance sampling (``grpo_tis_loss``) on GRPO
advantages (the shard's group-normalised ``rewards``) over support-restricted log-probs (the logits at
each response position, divided by the sampling temperature, renormalised over the token's support
from the shard's CSR mask): ``new`` at the current weights; ``old`` recomputed at the weights each
token was sampled under (its ``rollout_token_versions``: the checkpoints this trainer published);
``rollout`` the generator's. ``old`` equals ``rollout`` up to float rounding when the masks are right
(``mismatch_max`` says how close), and the full-vocabulary log-prob at the same weights shows what
ignoring the masks would cost (``full_vocab_mismatch_*``).

Contract:

* ``run_learn(options, *, log=None, on_progress=None) -> TrainResult``. On a fresh start it writes
  and publishes version 0 (the seeded initial policy) before training; after training batch ``seq``
  it writes ``weights/policy-v{seq+1:06d}.safetensors`` under ``checkpoint_dir`` and publishes version
  ``seq + 1`` with its ``file://`` URI, sha256 and size, then checkpoints (``checkpoint.pt`` with the
  published references in ``extra['versions']``, and ``trained.jsonl``). Killed and restarted, it
  resumes from the checkpoint and trains exactly the batches after it again, to the same losses
  and weights (on the CPU); a version published twice is the same file.
* One ``trained.jsonl`` row per rank per step: ``seq``, ``rank``, ``samples``, ``loss``,
  ``reward_mean`` (raw rewards), ``mean_abs_log_ratio``, ``clip_fraction``,
  ``tis_truncated_fraction``, ``ratio_mean``, ``ratio_p99``, ``ratio_max`` (``exp(new - old)``), ``mismatch_max``,
  ``full_vocab_mismatch_mean``, ``full_vocab_mismatch_p99``, ``staleness_max``, ``staleness_mean``
  (trainer version minus token version, sampled tokens), ``version`` (the weights it trained at)
  and ``elapsed_s`` (seconds since the run's first step began; informational, not replayed).
* A full disk is waited out (``rollout_bus.model.files.wait_for_disk``): a version is published only once
  its file is whole, a step counts as trained only once its checkpoint is.
* A token whose version has no published checkpoint here (a generator not following these weights)
  is a ``ContractError`` naming the version and the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollout_bus.consumers.feed.loop import (Checkpoint, FeedOptions, Publish, TrainProgress, TrainResult, run_training,
                                             step_over_ranks)
from rollout_bus.consumers.feed.trainer_feed import TrainBatch
from rollout_bus.consumers.feed.training import TrainState
from rollout_bus.errors import ConfigError, ContractError, must_be
from rollout_bus.model.files import wait_for_disk
from rollout_bus.model.trainer_math import grpo_tis_loss, response_token_index, shard_support_log_probs
from rollout_bus.policy.checkpoint import CheckpointRef, read_checkpoint, save_checkpoint
from rollout_bus.policy.model import best_device, build_policy, sequence_logits

logger = logging.getLogger(__name__)

WEIGHTS_DIR = "weights"
_KEPT_MODELS = 4  # old weights held for recomputation: versions a batch may span under a staleness bound


@dataclass
class LearnOptions(FeedOptions):
    """What ``run_learn`` trains on and how (the feed: ``FeedOptions``)."""

    seed: int = 0
    lr: float = 3e-3
    temperature: float = 1.0  # the generators' sampling temperature (their log-probs are of logits / T)
    clip_eps: float = 0.2
    tis_clip: float = 2.0
    device: str | None = None  # default: CUDA when present, else CPU

    def check(self) -> None:
        super().check()
        if not self.temperature > 0:
            raise ConfigError(must_be("temperature", "> 0", self.temperature))

    def shape(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed with these options."""
        return {"policy": "llama", "ranks": list(self.ranks), "dp_size": self.dp_size, "seed": self.seed,
                "lr": self.lr, "temperature": self.temperature}


class _PublishedWeights:
    """The checkpoints this trainer published, by version, and the models of the recent ones."""

    def __init__(self, refs: Mapping[int, dict[str, Any]], device: torch.device) -> None:
        self.refs = {int(v): dict(r) for v, r in refs.items()}
        self.device = device
        self._models: dict[int, torch.nn.Module] = {}

    def add(self, ref: CheckpointRef) -> None:
        self.refs[ref.version] = {"path": str(ref.path), "sha256": ref.sha256, "bytes": ref.bytes}

    def model(self, version: int, where: str) -> torch.nn.Module:
        if version not in self._models:
            ref = self.refs.get(version)
            if ref is None:
                raise ContractError(f"{where}: tokens of weights version {version}, which this trainer never "
                                    f"published (published: {sorted(self.refs)}); is the generator following "
                                    "this trainer's rollout.weights?")
            self._models[version] = read_checkpoint(ref["path"], ref["sha256"], self.device)[0]
            for old in sorted(self._models)[:-_KEPT_MODELS]:
                del self._models[old]
        return self._models[version]


def _response_logits(model: torch.nn.Module, tensors: Mapping[str, Any], index: torch.Tensor) -> torch.Tensor:
    """Logits ``[R, V]`` predicting each response token (from the position before it), shard order."""
    offsets = torch.as_tensor(tensors["tokens_offsets"]).to(torch.int64)
    tokens = torch.as_tensor(tensors["tokens"]).to(torch.int64)
    sequences = [tokens[offsets[i]:offsets[i + 1]] for i in range(offsets.numel() - 1)]
    logits = sequence_logits(model, sequences)
    sample = torch.bucketize(index, offsets[1:], right=True)  # which sample each response token is in
    position = index - offsets[sample]
    return logits[sample.to(logits.device), (position - 1).to(logits.device)]


def _support_and_full(logits: torch.Tensor, tensors: Mapping[str, Any], targets: torch.Tensor,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits / temperature
    full = scaled.log_softmax(-1).gather(1, targets.to(scaled.device).unsqueeze(1)).squeeze(1)
    return shard_support_log_probs(scaled, tensors), full


def rank_loss(model: torch.nn.Module, weights: _PublishedWeights, version: int, batch: TrainBatch,
              options: LearnOptions) -> tuple[torch.Tensor, dict[str, Any]]:
    """One rank's loss on its shard and the row that describes it (see the module docstring)."""
    tensors = batch.tensors
    index = response_token_index(tensors)
    targets = torch.as_tensor(tensors["tokens"]).to(torch.int64)[index]
    new, _ = _support_and_full(_response_logits(model, tensors, index), tensors, targets, options.temperature)
    rollout = torch.as_tensor(tensors["rollout_log_probs"]).to(new.device, new.dtype)
    versions = torch.as_tensor(tensors["rollout_token_versions"]).to(torch.int64).to(new.device)
    sampled = versions >= 0
    old, full = new.detach().clone(), torch.zeros_like(new)
    with torch.no_grad():
        for v in sorted(set(versions[sampled].tolist())):
            at = weights.model(v, f"batch {batch.seq} rank {batch.rank}") if v != version else model
            support_lp, full_lp = _support_and_full(_response_logits(at, tensors, index), tensors, targets,
                                                    options.temperature)
            rows = versions == v
            old[rows], full[rows] = support_lp[rows], full_lp[rows]
    lengths = torch.as_tensor(tensors["response_lengths"]).to(torch.int64)
    rewards = torch.as_tensor(tensors["rewards"]).to(new.device, new.dtype)
    advantages = torch.repeat_interleave(rewards, lengths.to(new.device), output_size=index.numel())
    loss_mask = torch.as_tensor(tensors["loss_masks"]).to(new.device)
    loss, stats = grpo_tis_loss(new, rollout, advantages, loss_mask, clip_eps=options.clip_eps,
                                tis_clip=options.tis_clip, old_log_probs=old)
    trained = (loss_mask > 0) & sampled
    ratio = (new.detach() - old)[trained].exp()
    mismatch = (old - rollout)[trained].abs()
    full_gap = (full - rollout)[trained].abs()
    staleness = (version - versions[trained]).double()
    row = {"seq": batch.seq, "rank": batch.rank, "samples": len(batch), **stats,
           "reward_mean": float(np.mean(np.asarray(tensors["raw_rewards"], np.float64))) if len(batch) else 0.0,
           "ratio_mean": _stat(ratio, "mean"), "ratio_p99": _stat(ratio, "p99"), "ratio_max": _stat(ratio, "max"),
           "mismatch_max": _stat(mismatch, "max"), "full_vocab_mismatch_mean": _stat(full_gap, "mean"),
           "full_vocab_mismatch_p99": _stat(full_gap, "p99"), "staleness_max": _stat(staleness, "max"),
           "staleness_mean": _stat(staleness, "mean"), "version": version}
    return loss, row


def _stat(values: torch.Tensor, kind: str) -> float:
    if values.numel() == 0:
        return 0.0
    values = values.double()
    if kind == "mean":
        return float(values.mean())
    if kind == "max":
        return float(values.max())
    return float(torch.quantile(values, 0.99))


def _step_line(seq: int, rows: list[dict[str, Any]]) -> str:
    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return (f"trained seq={seq} ranks={','.join(str(r['rank']) for r in rows)} loss={mean('loss'):.6f} "
            f"reward_mean={mean('reward_mean'):.4f} ratio_mean={mean('ratio_mean'):.4f} "
            f"clip_fraction={mean('clip_fraction'):.3f} mismatch_max={max(r['mismatch_max'] for r in rows):.2e} "
            f"full_vocab_mismatch_mean={mean('full_vocab_mismatch_mean'):.4f} "
            f"staleness_max={max(r['staleness_max'] for r in rows):.0f} version={rows[0]['version']} "
            f"samples={sum(r['samples'] for r in rows)}")


class LearnStep:
    """The real policy's part of the loop: the GRPO/TIS update at the published weights, every new version
    written and published before its batch counts as trained, and a checkpoint with every batch (saved
    before the batch's line; nothing left to save at the end)."""

    name = "train"

    def __init__(self, options: LearnOptions) -> None:
        self.options = options
        self.device = torch.device(options.device) if options.device else best_device()
        self.weights_dir = Path(options.checkpoint_dir) / WEIGHTS_DIR
        model = build_policy(options.seed, self.device)
        model.train()
        self.state = TrainState(model, torch.optim.Adam(model.parameters(), lr=options.lr))
        self.weights = _PublishedWeights({}, self.device)
        self.version = 0  # the weights the next batch trains at
        self.began: float | None = None  # when the run's first step began

    def shape(self) -> dict[str, Any]:
        return self.options.shape()

    def start(self, resumed: bool, next_seq: int | None, publish: Publish, log: logging.Logger) -> str:
        self.weights = _PublishedWeights(self.state.extra.get("versions") or {}, self.device)
        self.version = self.state.trained[-1] + 1 if self.state.trained else 0
        if not resumed:  # the initial weights, verified like every later version, before any generator needs them
            ref = self._publish(0, 0, publish)
            log.info("published weights version=0 path=%s sha256=%s", ref.path, ref.sha256)
        return f"weights version={self.version}"

    def train(self, batches: list[TrainBatch]) -> list[dict[str, Any]]:
        began = self.began = time.monotonic() if self.began is None else self.began

        def one_rank(batch: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            return rank_loss(self.state.policy, self.weights, self.version, batch, self.options)

        return step_over_ranks(self.state, batches, one_rank,
                               lambda row: {**row, "elapsed_s": round(time.monotonic() - began, 3)})

    def ship(self, seq: int, publish: Publish) -> None:
        self.version = seq + 1
        self._publish(self.version, seq, publish)  # the new weights are live: generators load them between steps
        self.state.extra["versions"] = self.weights.refs

    def _publish(self, version: int, step: int, publish: Publish) -> CheckpointRef:
        ref = wait_for_disk(lambda: save_checkpoint(self.state.policy, self.weights_dir, version, step),
                            f"weights version {version}")
        self.weights.add(ref)
        publish(ref.version, ref.step, uri=ref.path.resolve().as_uri(), sha256=ref.sha256, size=ref.bytes)
        return ref

    def commit(self, seq: int, rows: list[dict[str, Any]], metrics: Mapping[str, Any], checkpoint: Checkpoint,
               log: logging.Logger) -> None:
        checkpoint.save(f"the checkpoint after batch {seq}")  # a batch counts as trained once its checkpoint does
        log.info(_step_line(seq, rows))

    def finish(self, checkpoint: Checkpoint, log: logging.Logger) -> None:
        pass  # every trained batch is checkpointed already


def run_learn(options: LearnOptions, *, log: logging.Logger | None = None,
              on_progress: Callable[[TrainProgress], None] | None = None) -> TrainResult:
    """Train on the feeds until the run's end (or ``max_batches``); see the module docstring."""
    return run_training(options, LearnStep, log=log or logger, on_progress=on_progress)
