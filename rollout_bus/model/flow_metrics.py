"""The flow metrics a generator and a trainer measure of their own time (``rollout/flow/...``).

Why: asynchronous RL trades the generators' idle time (held back by the staleness bound) against the
trainer's (starved of batches); these two numbers say which side waits. The batch-side flow (sample age,
discarded tokens) is the shard writer's (``rollout_bus.consumers.shard_writer.flow``).

Contract (keys without the ``rollout/`` prefix, floats; fractions of ``elapsed_s``, 0.0 when it is 0):

* ``generator_flow(blocked_s, waits, elapsed_s)``: ``flow/generator/gate_blocked_s`` (seconds the
  staleness gate held groups back), ``flow/generator/gate_blocked_fraction``, ``flow/generator/gate_waits``.
* ``trainer_flow(waited_s, steps, elapsed_s)``: ``flow/trainer/wait_s`` (seconds spent waiting for the next
  batch), ``flow/trainer/wait_fraction``, ``flow/trainer/steps``.
"""

from __future__ import annotations


def _fraction(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0


def generator_flow(blocked_s: float, waits: int, elapsed_s: float) -> dict[str, float]:
    return {"flow/generator/gate_blocked_s": float(blocked_s),
            "flow/generator/gate_blocked_fraction": _fraction(blocked_s, elapsed_s),
            "flow/generator/gate_waits": float(waits)}


def trainer_flow(waited_s: float, steps: int, elapsed_s: float) -> dict[str, float]:
    return {"flow/trainer/wait_s": float(waited_s), "flow/trainer/wait_fraction": _fraction(waited_s, elapsed_s),
            "flow/trainer/steps": float(steps)}
