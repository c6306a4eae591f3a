"""Sampling with ``transformers``' own warpers, capturing each token's support from the warped scores.

The support of a sampled token is exactly the set of tokens the sampler could have picked: the
finite entries of the scores after the warpers ``generate(do_sample=True)`` builds (temperature, then
top-k, then top-p on the top-k survivors, then min-p, renormalised). Capturing it from those scores, rather than
recomputing it beside the sampler, is what makes the rollout log-prob and the trainer's
support-restricted recomputation the same function (miles #1521, prime-rl #3431).

Contract:

* ``Sampler(temperature, top_p, top_k, min_p)``: a warper is used only where it changes something, as
  ``generate`` does (temperature != 1, top_k > 0, top_p < 1, min_p > 0; min-p last, as SGLang applies it). ``warp(logits)`` is the warped float32
  ``[B, V]`` scores (``-inf`` outside the support).
* ``draw(logits, generator)`` -> ``StepDraw``: per row the sampled token (``torch.multinomial`` over the
  softmax of the warped scores, drawn on the CPU with the caller's seeded ``torch.Generator``, so the
  draw is the same on any device), its log-prob over the support (``log_softmax`` of the warped
  scores), its full-vocabulary log-prob at the same temperature (a diagnostic: what a trainer that
  ignored the mask would compute), and the support's ids (int32, ascending; always holding the token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from rollout_bus.errors import ConfigError, must_be


@dataclass(frozen=True)
class StepDraw:
    """One sampled token per row."""

    tokens: np.ndarray  # int64 [B]
    log_probs: np.ndarray  # float64 [B], over the support
    full_log_probs: np.ndarray  # float64 [B], over the whole vocabulary at the same temperature
    supports: list[np.ndarray]  # B rows of int32 ids, ascending


class Sampler:
    """Temperature, top-k and top-p as ``transformers`` applies them."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0) -> None:
        if not temperature > 0:
            raise ConfigError(must_be("temperature", "> 0", temperature))
        if not 0 < top_p <= 1:
            raise ConfigError(must_be("top_p", "in (0, 1]", top_p))
        if not 0 <= min_p < 1:
            raise ConfigError(must_be("min_p", "in [0, 1)", min_p))
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.min_p = float(min_p)
        warpers = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        if self.min_p > 0.0:  # after top-k and top-p, as SGLang applies it; the ratio to the top token is unchanged
            warpers.append(MinPLogitsWarper(self.min_p))
        self.warpers = LogitsProcessorList(warpers)

    def describe(self) -> dict[str, float | int]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.ndim != 2 or logits.shape[0] == 0:
            raise ConfigError(must_be("logits", "a non-empty [B, V] tensor", tuple(logits.shape)))
        scores = logits.detach().float().clone()
        return self.warpers(None, scores) if len(self.warpers) else scores

    def draw(self, logits: torch.Tensor, generator: torch.Generator) -> StepDraw:
        warped = self.warp(logits).cpu()
        choice = torch.multinomial(warped.softmax(-1), 1, generator=generator)
        support_lp = warped.log_softmax(-1).gather(1, choice).squeeze(1)
        full_lp = (logits.detach().float().cpu() / self.temperature).log_softmax(-1).gather(1, choice).squeeze(1)
        finite = torch.isfinite(warped).numpy()
        supports = [np.flatnonzero(row).astype(np.int32) for row in finite]
        return StepDraw(choice.squeeze(1).numpy().astype(np.int64), support_lp.double().numpy(),
                        full_lp.double().numpy(), supports)
