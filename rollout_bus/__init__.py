"""rollout-bus: Apache Kafka transport for LLM reinforcement-learning rollouts.

``rollout_bus.model`` is what a rollout is (docs/data-model.md) and ``rollout_bus.wire`` how it
travels (WIRE.md): pure data and math, no I/O to Kafka. The stages ``publish``, ``stream``,
``shard_writer`` and ``feed`` meet only through them (docs/pipeline.md); ``sim`` drives them as a
real generator and trainer would. ``rollout_bus.kafka`` is the one place for Kafka I/O;
``observe`` what operators watch; ``tools`` replay, inspect and the demo runner; ``cli`` the command
line (docs/architecture.md).

The public API: the names below are what code outside the project calls, importable from
``rollout_bus`` itself whatever module they live in, so moving a module breaks no user
(``tests/unit/test_public_api.py`` holds this list, the README's and the modules together). They
are imported on first use: ``import rollout_bus`` stays cheap (no torch, no Kafka client).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
PUBLIC_API: dict[str, str] = {
    # the data model (miles' names)
    "Sample": "rollout_bus.model.sample",
    "Status": "rollout_bus.model.sample",
    "AdapterRef": "rollout_bus.model.sample",
    "get_rollout_key": "rollout_bus.model.sample",
    "RolloutSamplingMask": "rollout_bus.model.sampling_mask",
    "SamplingMaskBuilder": "rollout_bus.model.sampling_mask",
    "append_forced_sampling_tokens": "rollout_bus.model.turns",
    "merge_samples": "rollout_bus.model.turns",
    "convert_samples_to_train_data": "rollout_bus.model.train_data",
    "split_train_data_by_dp": "rollout_bus.model.train_data",
    "load_shard": "rollout_bus.model.shards",
    "compute_statistics": "rollout_bus.model.metrics",
    "compute_episode_response_length_metrics": "rollout_bus.model.metrics",
    "compute_training_sample_metrics": "rollout_bus.model.metrics",
    "compute_metrics_from_samples": "rollout_bus.model.metrics",
    "compute_staleness_metrics": "rollout_bus.model.metrics",
    # the samples codec
    "encode_samples": "rollout_bus.wire.codec",
    "decode_samples": "rollout_bus.wire.codec",
    # publishing from an inference loop
    "TurnPublisher": "rollout_bus.producers.publisher",
    "turn_from_engine_response": "rollout_bus.producers.engine_adapter",
    "EngineClient": "rollout_bus.producers.engine_client",
    "publish_from_engine": "rollout_bus.producers.engine_client",
    "check_sampling_params": "rollout_bus.producers.engine_request",
    # the trainer's end
    "ShardFeed": "rollout_bus.consumers.feed.trainer_feed",
    "ShardFeedDataset": "rollout_bus.consumers.feed.dataset",
    "WeightPublisher": "rollout_bus.consumers.feed.weights",
    # the policy of `rollout-bus train`: recompute any log-prob the bus carried
    "load_policy": "rollout_bus.policy.checkpoint",
}
__all__ = sorted(PUBLIC_API)


def __getattr__(name: str) -> Any:
    home = PUBLIC_API.get(name)
    if home is None:
        raise AttributeError(f"module 'rollout_bus' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC_API])
