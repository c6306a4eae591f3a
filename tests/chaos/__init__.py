"""Fault-injection ("chaos") drills of the whole pipeline: `python -m tests.chaos [--quick] [--only NAME ...]`.

Each scenario runs the real stages as separate processes (generator, stream worker, shard writer)
on fresh topics with a fixed seed, injects its fault (kill -9 or SIGSTOP of a stage, a killed or
stopped broker, a killed leader or a rolling restart of a three-node cluster, a flood of malformed
turns, very long episodes), waits until every episode the generator finished is accounted for
(exactly one written batch, or the DLQ), and reports one row: episodes lost, duplicated,
dead-lettered, whether the shards are byte-identical to an undisturbed run with the same seed, the
time to recover, and pass/fail. ``harness`` runs one pipeline, ``faults`` injects, ``prompt_workload``
runs the prompt-fed generator group (its members killed, added, stopped), ``scenarios`` lists the table,
``evidence`` reads what a run left (shard digests, longest episode, log excerpts), ``runner`` owns the
brokers and prints the table.
"""
