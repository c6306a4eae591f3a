"""The trainer's end of the bus: one DP rank's shards in seq order, resumable, and weight versions back.

Consumes: rollout.shards (manifests) and the shard files. Produces: rollout.weights (the trainer's live version).
"""
