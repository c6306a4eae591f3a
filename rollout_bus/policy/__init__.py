"""The policy both ends run: a small seeded Llama, its character vocabulary, its sampler and checkpoints.

``rollout_bus.policy.load(path)`` is the one call outside code needs to recompute every log-prob the
bus carried: the model of a checkpoint, whose forward maps input ids ``[B, T]`` to logits ``[B, T, V]``.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load(path: str | Path, sha256: str | None = None, device: torch.device | str | None = None) -> torch.nn.Module:
    """The policy of checkpoint ``path`` (verified against ``sha256`` when given): a ``LlamaForCausalLM``."""
    from rollout_bus.policy.checkpoint import read_checkpoint

    return read_checkpoint(path, sha256, device)[0]
