"""Running the whole pipeline as a deployment would: each stage its own process, watched from outside.

Used by ``rollout-bus demo``. It starts stages as ``python -m rollout_bus.cli.<stage>`` processes (never
importing a stage), watches the topics for progress, and reconciles what the generator sent against
the shards written and the dead letters recorded.
"""
