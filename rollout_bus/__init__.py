"""rollout-bus: Apache Kafka transport for LLM reinforcement-learning rollouts.

The modules directly in this package are the data contracts (CONTRACTS.md): pure data and
math, no I/O to Kafka. ``rollout_bus.kafka`` holds the client wrappers and the local broker
manager; ``rollout_bus.cli`` the command line.
"""

__version__ = "0.1.0"
