"""The trainer's end of the bus: one DP rank's shards in seq order, resumable, and weight versions back;
and the one trainer loop (``loop``) both trainers run, the step (stand-in or real policy) the part that differs.

Consumes: rollout.shards (manifests) and the shard files. Produces: rollout.weights (the trainer's live version).
"""
