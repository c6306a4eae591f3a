"""The Faust stream stage: merges an episode's turns and accumulates windowed metrics.

Consumes: rollout.turns (turn samples). Produces: rollout.episodes (merged episodes), rollout.metrics (window metrics), rollout.dlq.
"""
