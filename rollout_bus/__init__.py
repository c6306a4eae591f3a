"""rollout-bus: Apache Kafka transport for LLM reinforcement-learning rollouts.

The modules directly in this package are the data contracts (CONTRACTS.md): pure data and
math, no I/O to Kafka. ``rollout_bus.kafka`` is the one place for Kafka I/O (every client, the
group-less reader, admin, the local broker); ``rollout_bus.observe`` what operators watch;
``rollout_bus.tools`` replay, inspect and the demo runner; ``rollout_bus.cli`` the command line.
"""

__version__ = "0.1.0"
