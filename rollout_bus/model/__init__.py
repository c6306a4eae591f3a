"""What a rollout is: the data model, pure data and math, no I/O to Kafka (docs/data-model.md).

``Sample`` and its ``RolloutSamplingMask``, the merging of turns, the rollout key's tuple, episode
statistics and the rollout metrics, trainer data and the shards on disk, and the trainer-side math.
"""
