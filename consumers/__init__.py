"""The shard writer: finished batches to data-parallel trainer shards.

Consumes: rollout.episodes (merged episodes). Produces: shard files, rollout.shards (manifests), rollout.metrics (batch metrics), rollout.dlq.
"""
