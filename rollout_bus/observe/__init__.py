"""What operators watch: the metrics view folded from rollout.metrics and rollout.dlq, the live feed
``tail`` and the Prometheus exporter share, the exporter, the run report with its charts (``report`` folds,
``report_html`` renders), and the run's flow (``flow_fold``, shown by the page and ``flow_tables``).

They read the topics through ``rollout_bus.kafka`` (group-less readers, no stage's group), never a
Kafka client of their own.
"""
