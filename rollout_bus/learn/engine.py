"""The generator's engine: the real policy, its weights swapped for new versions between decode steps.

An inference engine in an asynchronous RL loop must take new weights while it works. This one checks
before every decode step (one batched forward over the turns in flight) whether the trainer has
published a newer version on rollout.weights, and if so loads its checkpoint, verified by sha256; so
every token carries the version of the weights that really produced it, and a turn in flight when the
version changes holds tokens of both (the generator cuts it into an aborted part and its continuation).

Contract:

* ``PolicyEngine(seed, sampler, live=None, version=0, device=None)`` starts from ``build_policy(seed)`` as
  ``version``. ``live()`` returns the newest ``WeightVersion`` read from rollout.weights (or None).
* ``refresh()`` loads the newest published checkpoint when its version is at least the running one and
  it is not the one running (a version 0 checkpoint replaces the seed-built weights); a checkpoint that
  is missing, cannot be read or whose sha256 differs is refused: one ERROR line says what
  (``weights version 3 at file:///w/policy-v000003.safetensors: sha256 mismatch (...)``, or ``...: missing``)
  and which version the engine still uses (``using()``: ``still using version 2``, or that none was loaded),
  the engine keeps the version it has, and does not try that (version, sha256) again. ``refused`` maps
  each refused (version, sha256) to what was wrong (``version 3 at URI: missing``).
* ``generate(contexts, generator, max_tokens=TURN_TOKENS)`` samples up to ``max_tokens`` tokens after each
  context (a row stops after ``$``), one batched forward per step, and returns a ``TurnOutput`` per
  context: tokens, log-probs over the captured support, full-vocabulary log-probs, supports and the
  version each token was sampled under.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout_bus.learn.task import TURN_TOKENS
from rollout_bus.policy.checkpoint import CheckpointError, read_checkpoint
from rollout_bus.policy.model import best_device, build_policy, last_logits
from rollout_bus.policy.sampler import Sampler
from rollout_bus.policy.vocab import EOS, VOCAB
from rollout_bus.wire.weight_version import WeightVersion

logger = logging.getLogger(__name__)

LiveWeights = Callable[[], WeightVersion | None]


@dataclass
class TurnOutput:
    """What one context's turn sampled, token by token."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    full_log_probs: list[float] = field(default_factory=list)
    supports: list[np.ndarray] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


class PolicyEngine:
    """The live weights and the sampler (see the module docstring)."""

    def __init__(self, seed: int, sampler: Sampler, *, live: LiveWeights | None = None, version: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else best_device()
        self.model = build_policy(seed, self.device)
        self.sampler, self.live, self.version = sampler, live, int(version)
        self.loaded: tuple[int, str] | None = None
        self.refused: dict[tuple[int, str], str] = {}
        self.loads = 0

    def refresh(self) -> int:
        """Take the newest published weights if they are new (see the module docstring); the running version."""
        latest = self.live() if self.live is not None else None
        if latest is None or latest.path is None or latest.sha256 is None:
            return self.version
        key = (latest.version, latest.sha256)
        if latest.version < self.version or key == self.loaded or key in self.refused:
            return self.version
        try:
            model, _ = read_checkpoint(latest.path, latest.sha256, self.device)
        except CheckpointError as exc:
            self.refused[key] = f"version {latest.version} at {latest.uri}: {exc.problem}"
            logger.error("weights %s, refused; %s", self.refused[key], self.using())
            return self.version
        self.model, self.version, self.loaded = model, latest.version, key
        self.loads += 1
        logger.info("loaded weights version=%d from %s", latest.version, latest.path)
        return self.version

    def using(self) -> str:
        """Which published weights it generates from, in words: the version loaded, or that there is none."""
        if self.loaded is None:
            return "no published weights loaded yet: none to generate from"
        return f"still using version {self.version}"

    @torch.no_grad()
    def generate(self, contexts: list[np.ndarray], generator: torch.Generator,
                 max_tokens: int = TURN_TOKENS) -> list[TurnOutput]:
        outs = [TurnOutput() for _ in contexts]
        stop = VOCAB.id(EOS)
        for _ in range(max_tokens):
            active = [i for i, out in enumerate(outs) if not out.done]
            if not active:
                break
            version = self.refresh()
            rows = [np.concatenate([contexts[i], np.asarray(outs[i].tokens, np.int64)]) for i in active]
            draw = self.sampler.draw(last_logits(self.model, rows), generator)
            for j, i in enumerate(active):
                out, token = outs[i], int(draw.tokens[j])
                out.tokens.append(token)
                out.log_probs.append(float(draw.log_probs[j]))
                out.full_log_probs.append(float(draw.full_log_probs[j]))
                out.supports.append(draw.supports[j])
                out.versions.append(version)
                out.done = token == stop
        return outs
