"""Temperature, top-k, top-p and min-p sampling that reports every token's support (docs/data-model.md section 2).

Contract (the math inference engines use, e.g. SGLang's torch sampler):

* Logits are divided by ``temperature`` and soft-maxed over the whole vocabulary. The passes over
  the vocabulary run in float32 (they dominate the cost); everything on the kept tokens (the
  nucleus cut, the renormalisation, the log-probs) runs in float64.
* The support is the smallest prefix of tokens, in decreasing probability, whose mass reaches
  ``top_p``, cut to at most ``top_k`` tokens (``top_k <= 0``: no limit) and never empty: token i
  of the sorted order is kept when ``i < top_k`` and the mass before it is ``< top_p``;
  ``top_p = 1`` keeps every token (up to ``top_k``), as engines treat it: no nucleus filter. ``min_p``
  (SGLang's min-p, after top-k and top-p) drops a token whose probability is below ``min_p`` times the most
  likely token's (both over the whole vocabulary); ``min_p = 0`` drops nothing.
* The token is drawn from the support renormalised (``torch.multinomial`` with the caller's
  seeded ``torch.Generator``) and its log-prob is ``log(p_token / sum(p_support))``, the
  behaviour log-prob a trainer replays against the same support.
* ``Draw.supports[b]`` holds row b's support ids (int32) in decreasing probability; it always
  contains ``Draw.tokens[b]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout_bus.errors import ConfigError, must_be


@dataclass(frozen=True)
class SamplingParams:
    """The knobs that select the support."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(must_be("temperature", "> 0", self.temperature))
        if not 0 < self.top_p <= 1:
            raise ConfigError(must_be("top_p", "in (0, 1]", self.top_p))
        if not 0 <= self.min_p < 1:
            raise ConfigError(must_be("min_p", "in [0, 1)", self.min_p))

    def width(self, vocab_size: int) -> int:
        """How many top tokens can ever be in a support."""
        return vocab_size if self.top_k <= 0 else min(int(self.top_k), vocab_size)


@dataclass(frozen=True)
class Draw:
    """One sampled token per batch row, with its log-prob and support."""

    tokens: np.ndarray  # int64 [B]
    log_probs: np.ndarray  # float64 [B]
    supports: list[np.ndarray]  # B rows of int32 ids


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Draw:
    """Draw one token per row of ``logits`` ``[B, V]`` from its top-k/top-p/min-p support."""
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ConfigError(must_be("logits", "a non-empty [B, V] tensor", tuple(logits.shape)))
    scaled = logits.to(torch.float32) / params.temperature
    normaliser = torch.logsumexp(scaled, dim=-1, keepdim=True).to(torch.float64)
    top_values, top_ids = torch.topk(scaled, params.width(scaled.shape[-1]), dim=-1, sorted=True)
    top_values = top_values.to(torch.float64)
    probs = torch.exp(top_values - normaliser)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = mass_before < params.top_p
    keep[:, 0] = True
    if params.top_p >= 1.0:  # no nucleus cut: tail tokens whose mass rounds away stay in the support
        keep[:] = True
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs[:, :1]
    kept_values = top_values.masked_fill(~keep, float("-inf"))
    support_lse = torch.logsumexp(kept_values, dim=-1, keepdim=True)
    support_probs = torch.exp(kept_values - support_lse)
    choice = torch.multinomial(support_probs, 1, generator=generator)
    log_probs = (torch.gather(kept_values, 1, choice) - support_lse).squeeze(1)
    tokens = torch.gather(top_ids, 1, choice).squeeze(1)
    sizes = keep.sum(dim=-1).numpy()
    ids = top_ids.numpy().astype(np.int32)
    supports = [ids[b, : sizes[b]] for b in range(ids.shape[0])]
    return Draw(tokens.numpy().astype(np.int64), log_probs.numpy().astype(np.float64), supports)
