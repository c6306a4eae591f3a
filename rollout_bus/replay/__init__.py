"""Replay from topic offsets: the stream merge and the shard writer's batching re-run, in process, over a range of
the log, to rebuild a batch byte for byte or show where it diverges. It sits above the stages it re-runs and
uses their own pure logic, never a copy of it.
"""
