"""A small simulated trainer: the shard feed's consumer for the demo and the tests.

It trains a tiny seeded policy (an embedding of the previous token and a linear head over the
vocabulary) on every DP rank's shards as they are announced on rollout.shards, with the GRPO
surrogate of ``rollout_bus.model.trainer_math`` on log-probs renormalised over each token's sampling
support, and checkpoints atomically, so a trainer killed at any moment resumes where its last
checkpoint was and trains exactly the batches after it again.

Contract:

* ``run_train_sim(options, *, log=None, on_progress=None) -> TrainSimResult`` opens one
  ``rollout_bus.feed.trainer_feed.ShardFeed`` per rank of ``options.ranks``. Each step takes the next batch
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
* ``staleness_problems(manifests, max_staleness)``: the closed loop's check of a run: no batch
  metric ``staleness/max`` or ``staleness/oldest`` above the bound, no episode dead-lettered stale.
* ``reconcile_training(written_seqs, rows, ranks)`` checks a finished run: every written seq
  trained exactly once per rank, in seq order, and nothing else; ``read_trained(checkpoint_dir)``
  reads ``trained.jsonl``.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout_bus.feed.trainer_feed import ShardFeed, TrainBatch
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError, ContractError, must_be
from rollout_bus.model.shards import write_atomic
from rollout_bus.model.trainer_math import grpo_tis_loss, shard_support_log_probs

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
TRAINED_NAME = "trained.jsonl"
DEFAULT_VOCAB_SIZE = GenerateSettings.model_fields["vocab_size"].default
_MASK_IDS = "rollout_sampling_mask_ids"
_LOGGED_METRICS = ("episode_raw_reward", "response_len/mean")


@dataclass
class TrainSimOptions:
    """What ``run_train_sim`` trains on and how."""

    bootstrap_servers: str
    checkpoint_dir: Path
    ranks: list[int] = field(default_factory=lambda: [0])
    dp_size: int = 1
    kafka: dict[str, Any] = field(default_factory=dict)  # further connection settings (SASL/SSL)
    topic_prefix: str = ""
    shards_root: Path | None = None
    checkpoint_every: int = 2
    seed: int = 0
    lr: float = 1e-3
    dim: int = 16
    vocab_size: int = DEFAULT_VOCAB_SIZE  # the generator's; shards do not record it
    timeout_s: float = 600.0
    max_batches: int | None = None
    step_delay_s: float = 0.0  # a pause after each step: slows the trainer down for drills and demos
    torch_threads: int = 1  # 0: torch's default
    publish_weights: bool = True  # after training batch k, version k + 1 goes to rollout.weights

    def check(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(must_be("ranks", "a non-empty list of distinct ranks", self.ranks))
        if any(not 0 <= r < self.dp_size for r in self.ranks):
            raise ConfigError(must_be("ranks", f"ranks in [0, dp_size = {self.dp_size})", self.ranks))
        if self.checkpoint_every < 1:
            raise ConfigError(must_be("checkpoint_every", ">= 1", self.checkpoint_every))
        if self.max_batches is not None and self.max_batches < 0:
            raise ConfigError(must_be("max_batches", ">= 0 or None", self.max_batches))
        if self.vocab_size < 2 or self.dim < 1:
            raise ConfigError(must_be("vocab_size, dim", ">= 2, >= 1", (self.vocab_size, self.dim)))

    def shape(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed with these options."""
        return {"vocab_size": self.vocab_size, "dim": self.dim, "ranks": list(self.ranks), "dp_size": self.dp_size,
                "seed": self.seed}


@dataclass
class TrainSimResult:
    batches: int  # trained in the whole training, resumed ones included
    batches_this_run: int
    last_seq: int | None
    final_loss: float | None
    resumed_from: int  # batches already trained by the checkpoint found at start
    checkpoint: Path

    def summary(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.6f}"
        return (f"train-sim: trained batches={self.batches} (this run {self.batches_this_run}, resumed after "
                f"{self.resumed_from}) last_seq={self.last_seq} final_loss={loss} checkpoint={self.checkpoint}")


@dataclass
class TrainSimProgress:
    batches: int
    last_seq: int | None
    loss: float | None


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


def response_token_index(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Index into the flat ``tokens`` of every response token, in shard order, ``[R]`` int64."""
    offsets = tensors["tokens_offsets"].to(torch.int64)
    lengths = tensors["response_lengths"].to(torch.int64)
    total = int(lengths.sum())
    starts_in_shard = lengths.cumsum(0) - lengths
    shift = offsets[1:] - lengths - starts_in_shard
    return torch.arange(total) + torch.repeat_interleave(shift, lengths, output_size=total)


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


# ---------------------------------------------------------------------------- checkpoints


def _atomic_torch_save(obj: Any, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, buffer.getvalue())


def trained_jsonl(history: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in history).encode()


def read_trained(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``trained.jsonl`` (empty when there is none yet)."""
    path = Path(checkpoint_dir) / TRAINED_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class TrainState:
    """Everything a checkpoint holds besides the feeds."""

    policy: TinyPolicy
    optimizer: torch.optim.Optimizer
    trained: list[int] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)

    def save(self, checkpoint_dir: Path, feeds: Mapping[int, ShardFeed], shape: dict[str, Any]) -> None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save({"model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                            "feeds": {rank: feed.state_dict() for rank, feed in feeds.items()},
                            "trained": list(self.trained), "history": list(self.history),
                            "rng": torch.get_rng_state(), "shape": shape}, checkpoint_dir / CHECKPOINT_NAME)
        write_atomic(checkpoint_dir / TRAINED_NAME, trained_jsonl(self.history))

    def load(self, checkpoint_dir: Path, feeds: Mapping[int, ShardFeed], shape: dict[str, Any]) -> bool:
        """Resume from ``checkpoint_dir`` when it holds a checkpoint; True when it did."""
        path = checkpoint_dir / CHECKPOINT_NAME
        if not path.exists():
            return False
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("shape") != shape:
            raise ConfigError(must_be("checkpoint", f"of a training shaped {shape}", saved.get("shape"),
                                      where=str(path)))
        self.policy.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        for rank, feed in feeds.items():
            feed.load_state_dict(saved["feeds"][rank])
        self.trained, self.history = list(saved["trained"]), list(saved["history"])
        torch.set_rng_state(saved["rng"])
        write_atomic(checkpoint_dir / TRAINED_NAME, trained_jsonl(self.history))  # it may lag a checkpoint
        return True


# ---------------------------------------------------------------------------- the loop


def _next_batches(feeds: Mapping[int, ShardFeed]) -> list[TrainBatch] | None:
    """The next batch of every rank (one seq), or None when every feed reached the run's end."""
    batches = {rank: feed.next_batch() for rank, feed in feeds.items()}
    if all(b is None for b in batches.values()):
        return None
    seqs = {rank: (b.seq if b is not None else "end of run") for rank, b in batches.items()}
    if len(set(seqs.values())) != 1:
        raise ContractError(f"the ranks' feeds disagree on the next batch: {seqs} (rank: seq); every rank must "
                            "train the same seq in a step")
    return [b for b in batches.values() if b is not None]


def train_step(state: TrainState, batches: list[TrainBatch]) -> list[dict[str, Any]]:
    """One optimizer step over every rank's shard of one batch; a history row per rank."""
    state.optimizer.zero_grad(set_to_none=True)
    rows = []
    for batch in batches:
        loss, stats = rank_loss(state.policy, batch.tensors)
        (loss / len(batches)).backward()  # summed over ranks: the all-reduced gradient
        rows.append({"seq": batch.seq, "rank": batch.rank, "samples": len(batch), **stats})
    state.optimizer.step()
    return rows


def _step_line(seq: int, rows: list[dict[str, Any]], metrics: Mapping[str, Any]) -> str:
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("loss", "mean_abs_log_ratio", "clip_fraction")}
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in _LOGGED_METRICS if isinstance(metrics.get(k), (int, float)))
    return (f"trained seq={seq} ranks={','.join(str(r['rank']) for r in rows)} loss={mean['loss']:.6f} "
            f"mean_abs_log_ratio={mean['mean_abs_log_ratio']:.4f} clip_fraction={mean['clip_fraction']:.3f} "
            f"samples={sum(r['samples'] for r in rows)} {shown}").rstrip()


def run_train_sim(options: TrainSimOptions, *, log: logging.Logger | None = None,
                  on_progress: Callable[[TrainSimProgress], None] | None = None) -> TrainSimResult:
    """Train on the feeds until the run's end (or ``max_batches``); see the module docstring."""
    options.check()
    log = log or logger
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    checkpoint_dir = Path(options.checkpoint_dir)
    policy = build_policy(options.vocab_size, options.dim, options.seed)
    state = TrainState(policy, torch.optim.Adam(policy.parameters(), lr=options.lr))
    feeds = {rank: ShardFeed(options.bootstrap_servers, rank=rank, dp_size=options.dp_size,
                             shards_root=options.shards_root, topic_prefix=options.topic_prefix,
                             timeout_s=options.timeout_s, **options.kafka) for rank in options.ranks}
    shape = {**options.shape(), "topic": next(iter(feeds.values())).topic}
    try:
        resumed = state.load(checkpoint_dir, feeds, shape)
        resumed_from = len(state.trained)
        if resumed:
            log.info("resumed from checkpoint=%s batches=%d next_seq=%s", checkpoint_dir / CHECKPOINT_NAME,
                     resumed_from, next(iter(feeds.values())).next_seq)
        saved_at = resumed_from if resumed else -1
        while options.max_batches is None or len(state.trained) < options.max_batches:
            batches = _next_batches(feeds)
            if batches is None:
                break
            seq = batches[0].seq
            rows = train_step(state, batches)
            if options.publish_weights:  # the new weights are live: generators may start the next batches
                feeds[options.ranks[0]].publish_version(seq + 1, seq)
            state.trained.append(seq)
            state.history.extend(rows)
            log.info(_step_line(seq, rows, batches[0].metrics))
            if len(state.trained) % options.checkpoint_every == 0:
                state.save(checkpoint_dir, feeds, shape)
                saved_at = len(state.trained)
                log.info("checkpoint batches=%d last_seq=%d path=%s", saved_at, seq, checkpoint_dir / CHECKPOINT_NAME)
            if on_progress is not None:
                on_progress(TrainSimProgress(len(state.trained), seq, _mean_loss(state.history, seq)))
            if options.step_delay_s > 0:
                time.sleep(options.step_delay_s)
        if saved_at != len(state.trained):
            state.save(checkpoint_dir, feeds, shape)
            log.info("checkpoint batches=%d last_seq=%s path=%s (end)", len(state.trained),
                     state.trained[-1] if state.trained else None, checkpoint_dir / CHECKPOINT_NAME)
    finally:
        for feed in feeds.values():
            feed.close()
    last = state.trained[-1] if state.trained else None
    return TrainSimResult(batches=len(state.trained), batches_this_run=len(state.trained) - resumed_from,
                          last_seq=last, final_loss=None if last is None else _mean_loss(state.history, last),
                          resumed_from=resumed_from, checkpoint=checkpoint_dir / CHECKPOINT_NAME)


def _mean_loss(history: list[dict[str, Any]], seq: int) -> float | None:
    losses = [row["loss"] for row in history if row["seq"] == seq]
    return sum(losses) / len(losses) if losses else None


# ---------------------------------------------------------------------------- reconciling a run


@dataclass
class TrainingCheck:
    """Whether every written batch was trained exactly once per rank, in seq order."""

    written: list[int]
    ranks: list[int]
    missing: dict[int, list[int]] = field(default_factory=dict)     # rank -> written seqs never trained
    duplicated: dict[int, list[int]] = field(default_factory=dict)  # rank -> seqs trained more than once
    unexpected: dict[int, list[int]] = field(default_factory=dict)  # rank -> seqs trained but not written
    out_of_order: dict[int, list[int]] = field(default_factory=dict)  # rank -> its trained seqs, when unsorted
    batches: int = 0
    last_seq: int | None = None
    final_loss: float | None = None

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected or self.out_of_order)

    def problems(self) -> list[str]:
        out = []
        for name in ("missing", "duplicated", "unexpected", "out_of_order"):
            value = getattr(self, name)
            if value:
                out.append(f"training {name.replace('_', ' ')} (rank: seqs): {value}")
        return out

    def summary(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.6f}"
        verdict = "every written batch trained once per rank, in order" if self.ok else "MISMATCH"
        return (f"training: {self.batches} batches trained on ranks {','.join(map(str, self.ranks))} "
                f"(written {len(self.written)}), last seq {self.last_seq}, final loss {loss}: {verdict}")


def reconcile_training(written_seqs: Iterable[int], rows: Iterable[Mapping[str, Any]],
                       ranks: Iterable[int]) -> TrainingCheck:
    """Match the written batch seqs against ``trained.jsonl``'s rows (see the module docstring)."""
    rows = list(rows)
    check = TrainingCheck(written=sorted(int(s) for s in written_seqs), ranks=sorted(int(r) for r in ranks))
    written = set(check.written)
    by_rank: dict[int, list[int]] = {rank: [] for rank in check.ranks}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), []).append(int(row["seq"]))
    for rank, seqs in sorted(by_rank.items()):
        if rank not in check.ranks:
            check.unexpected[rank] = sorted(set(seqs))
            continue
        if missing := sorted(written - set(seqs)):
            check.missing[rank] = missing
        if duplicated := sorted({s for s in seqs if seqs.count(s) > 1}):
            check.duplicated[rank] = duplicated
        if unexpected := sorted(set(seqs) - written):
            check.unexpected[rank] = unexpected
        if seqs != sorted(seqs):
            check.out_of_order[rank] = seqs
    seqs_trained = sorted({int(row["seq"]) for row in rows})
    check.batches = len(seqs_trained)
    check.last_seq = seqs_trained[-1] if seqs_trained else None
    if check.last_seq is not None:
        check.final_loss = _mean_loss([dict(r) for r in rows], check.last_seq)
    return check



def staleness_problems(manifests: Iterable[Mapping[str, Any]], max_staleness: int) -> tuple[list[str], int]:
    """The closed loop's check over written batches: no trained token more than ``max_staleness``
    steps stale (every ``staleness/max`` and ``staleness/oldest`` batch metric, adapter-scoped ones
    included), and no episode the shard writer's net dead-lettered as stale (which happens only when a
    generator ignored the bound). Returns the problems and the largest staleness seen."""
    problems, worst = [], 0
    for manifest in manifests:
        seq, metrics = manifest.get("seq"), manifest.get("metrics") or {}
        found = {k: v for k, v in metrics.items() if k.endswith(("staleness/max", "staleness/oldest"))
                 and isinstance(v, (int, float))}
        if not found:
            problems.append(f"batch {seq} has no staleness metrics (its samples carry no weight version)")
        worst = max([worst, *found.values()])
        problems += [f"batch {seq}: {k} = {v} > max staleness {max_staleness}" for k, v in sorted(found.items())
                     if v > max_staleness]
        stale = (manifest.get("extra") or {}).get("stale") or []
        if stale:
            problems.append(f"batch {seq}: {len(stale)} episodes dead-lettered as stale (a generator ignored the bound)")
    return problems, int(worst)
