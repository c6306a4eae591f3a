"""What reads finished episodes: the shard writer (episodes to trainer shards) and the trainer's feed (shards to
a DP rank, weight versions back). Two stages that never import each other; they meet on rollout.shards.
"""
