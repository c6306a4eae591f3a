"""The built-in simulator: a seeded generator (environment, policy stand-in, sampler, faults) and a trainer stand-in.

Not a stage of its own: it drives the publishing library (``rollout_bus.producers``) as a real inference loop
would, and reads the trainer feed (``rollout_bus.consumers.feed``) as a real trainer would, for the demo, tests and benches.
"""
