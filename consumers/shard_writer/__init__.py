"""The shard writer: finished batches to data-parallel trainer shards.

Consumes: rollout.episodes (merged episodes; ``abandoned`` and ``end-of-run`` control records). Produces: shard files, rollout.shards (manifests), rollout.metrics (batch metrics), rollout.dlq.
"""
