"""The policy itself: a small Llama built from a config, seeded, the same on the generator and the trainer.

``transformers``' ``LlamaForCausalLM`` rather than a hand-written network: it is the model family the
fleets serve, its forward is the one outside code will use to recompute our log-probs, and nothing
about it is ours to get wrong. It is built from ``policy_config()`` (no hub, no download) with the
global RNG seeded inside a fork, so one seed gives the same initial weights on every machine with
the same torch build. Embeddings are tied: the unembedding then starts with a small bias towards
repeating the current token, which is what lets a random model copy a tool's answer now and then.

Contract:

* ``build_policy(seed, device=None)`` -> ``LlamaForCausalLM`` in float32 (on ``device``, default CPU).
* ``last_logits(model, contexts)``: float32 ``[B, V]`` logits of the next token after each context
  (a list of 1-D int sequences, right-padded into one forward: causal attention never looks at the
  padding after a position).
* ``sequence_logits(model, sequences)``: float32 ``[B, T, V]`` logits of every position, right-padded;
  the trainer takes position p - 1 for the token at p.
* ``best_device()``: CUDA when present, else CPU. Nothing depends on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_bus.policy.vocab import BOS, EOS, PAD, VOCAB

MAX_POSITIONS = 64


def policy_config() -> LlamaConfig:
    """The one architecture: 2 layers, width 64, 4 heads, over the character vocabulary."""
    return LlamaConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=True, bos_token_id=VOCAB.id(BOS), eos_token_id=VOCAB.id(EOS),
                       pad_token_id=VOCAB.id(PAD), attn_implementation="eager")


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def model_from_config(config: LlamaConfig, device: torch.device | str | None = None) -> LlamaForCausalLM:
    config._attn_implementation = "eager"  # one attention code path on every device: exact replays
    model = LlamaForCausalLM(config).to(dtype=torch.float32, device=device or "cpu")
    model.eval()  # no dropout anywhere; training mode changes nothing but is never needed
    return model


def build_policy(seed: int, device: torch.device | str | None = None) -> LlamaForCausalLM:
    """The initial weights fixed by ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return model_from_config(policy_config(), device)


def _padded(model: LlamaForCausalLM, sequences: Sequence[Sequence[int] | np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(s) for s in sequences]
    batch = torch.full((len(sequences), max(lengths)), VOCAB.id(PAD), dtype=torch.int64)
    for row, seq in enumerate(sequences):
        batch[row, : len(seq)] = torch.as_tensor(np.asarray(seq, dtype=np.int64))
    return batch.to(model.device), lengths


def sequence_logits(model: LlamaForCausalLM, sequences: Sequence[Sequence[int] | np.ndarray]) -> torch.Tensor:
    """Float32 logits ``[B, T, V]`` of every position of the right-padded ``sequences``."""
    batch, _ = _padded(model, sequences)
    return model(input_ids=batch, use_cache=False).logits.float()


def last_logits(model: LlamaForCausalLM, contexts: Sequence[Sequence[int] | np.ndarray]) -> torch.Tensor:
    """Float32 logits ``[B, V]`` of the token after each context."""
    batch, lengths = _padded(model, contexts)
    logits = model(input_ids=batch, use_cache=False).logits
    last = torch.as_tensor(lengths, device=logits.device) - 1
    return logits[torch.arange(len(contexts), device=logits.device), last].float()
