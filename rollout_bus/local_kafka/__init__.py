"""Brokers for development and fault drills: the Kafka jars fetched from Maven Central, a single-node
broker and a three-node KRaft cluster on 127.0.0.1. Nothing in the pipeline imports them.
"""
