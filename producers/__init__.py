"""Rollout generators and the turn publisher.

Consumes: nothing (an inference engine or the built-in generator). Produces: rollout.turns (one turn sample per record).
"""
