"""Operator tools: live tail, Prometheus exporter, replay from offsets, record inspection, run reports.

They read the topics from outside the pipeline (their own consumers, no consumer group of a stage),
and may reuse a stage's pure logic (batching, merging) so that a replay rebuilds exactly what the
stage wrote.
"""
