"""A small seeded stand-in for an LLM: realistic, peaked next-token logits, computed in batches.

Contract:

* ``Policy(vocab_size, seed, dim=32, buckets=8192)`` is fixed by its seed: the same seed gives the
  same logits for the same contexts, on any machine with the same torch build.
* ``logits(prev, last, salt)`` takes, for a batch of B rollouts, the two most recent tokens of
  each context and a per-rollout salt (the adapter slot: each LoRA adapter is its own policy) and
  returns float32 logits ``[B, vocab_size]``. The context is hashed to one of ``buckets`` states;
  logits are ``sharpness(state) * (embedding(state) @ table) + zipf_prior``: one ``[B, d] @ [d, V]``
  matmul per step. The Zipf-like prior gives a realistic frequency profile over the vocabulary and
  the per-state sharpness mixes confident steps (a support of one or two tokens under top-p 0.95)
  with uncertain ones (dozens), as a real model does.
"""

from __future__ import annotations

import math

import torch

from rollout_bus.errors import ConfigError, must_be

_HASH_PREV = 2654435761  # Knuth's multiplicative hash constants: cheap, well-spread buckets
_HASH_SALT = 40503
_MIN_SHARPNESS = 5.0
_SHARPNESS_SPREAD = 9.0
_ZIPF_EXPONENT = 1.0


class Policy:
    """Batched next-token logits from a hashed context state and a fixed random projection."""

    def __init__(self, vocab_size: int, seed: int, *, dim: int = 32, buckets: int = 8192) -> None:
        if vocab_size < 2:
            raise ConfigError(must_be("vocab_size", ">= 2", vocab_size))
        if dim < 1 or buckets < 1:
            raise ConfigError(must_be("dim and buckets", ">= 1", (dim, buckets)))
        self.vocab_size = int(vocab_size)
        self.buckets = int(buckets)
        gen = torch.Generator().manual_seed(int(seed))
        self._table = torch.randn(dim, vocab_size, generator=gen) / math.sqrt(dim)
        self._states = torch.randn(buckets, dim, generator=gen)
        self._sharpness = _MIN_SHARPNESS + _SHARPNESS_SPREAD * torch.rand(buckets, 1, generator=gen)
        rank = torch.randperm(vocab_size, generator=gen)
        self._prior = -_ZIPF_EXPONENT * torch.log1p(rank.to(torch.float32))

    def bucket(self, prev: torch.Tensor, last: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
        """The hashed context state of each rollout (int64 ``[B]``)."""
        mixed = prev.to(torch.int64) * _HASH_PREV + last.to(torch.int64) + salt.to(torch.int64) * _HASH_SALT
        return torch.remainder(mixed, self.buckets)

    def logits(self, prev: torch.Tensor, last: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[B, vocab_size]`` for the batch's contexts."""
        state = self.bucket(prev, last, salt)
        scores = self._states[state] @ self._table
        return torch.addcmul(self._prior, self._sharpness[state], scores)
