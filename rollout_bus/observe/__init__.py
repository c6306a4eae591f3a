"""What operators watch: the metrics view folded from rollout.metrics and rollout.dlq, the live feed
``tail`` and the Prometheus exporter share, the exporter, and the run report with its charts.

They read the topics through ``rollout_bus.kafka`` (group-less readers, no stage's group), never a
Kafka client of their own.
"""
