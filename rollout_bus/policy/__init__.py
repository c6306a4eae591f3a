"""The policy both ends run: a small seeded Llama, its character vocabulary, its sampler and checkpoints.

``rollout_bus.load_policy(path)`` (``policy.checkpoint``) is the one call outside code needs to
recompute every log-prob the bus carried: the model of a checkpoint, whose forward maps input ids
``[B, T]`` to logits ``[B, T, V]``.
"""
