"""Publishing one generator's run: every turn, a running summary, then the run's close.

Any generator (the simulated one, the real policy's) hands its turns here as ``(sample, publish_turn
kwargs)``; this sends them, keeps the summary the CLI prints and writes, and closes the run.

Contract:

* ``publish_turns(turns, publisher, *, run_id="", end_of_run=True, progress=None, gate=None, before_flush=None)``
  sends every turn with ``publisher.publish_turn``, calls ``progress(summary)`` after each, then
  ``before_flush(summary, last_final)`` (the simulated generator's deliberate faults), flushes, and with
  ``end_of_run`` closes the run (``run_id``, or a fresh uuid hex) with ``publisher.publish_end_of_run``
  once everything is acknowledged. It returns the ``GenerateSummary``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rollout_bus.model.sample import Sample, Status
from rollout_bus.producers.staleness_gate import StalenessGate
from rollout_bus.wire.rollout_key import rollout_key_of

logger = logging.getLogger(__name__)


@dataclass
class GenerateSummary:
    """What a run sent: the finished episodes (key string, attempt of the final turn), turns, bytes
    (turn and fault records' keys plus values, headers and end-of-run records excluded), the
    deliberate faults, the run id, and on how many partitions the run was closed (0: not closed). With a
    staleness gate: the least and greatest live weight versions seen, and the waits for the trainer."""

    episodes: list[tuple[str, int]] = field(default_factory=list)
    turns_sent: int = 0
    interrupted_turns: int = 0  # turns cut by new weights (each sent as an ABORTED part and its continuation)
    bytes_sent: int = 0
    faults: list[dict] = field(default_factory=list)
    run_id: str = ""
    end_of_run_partitions: int = 0
    live_version_min: int | None = None
    live_version_max: int | None = None
    weight_waits: int = 0
    weight_waited_s: float = 0.0

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "episodes": [list(e) for e in self.episodes],
                "episodes_finished": len(self.episodes), "turns_sent": self.turns_sent,
                "interrupted_turns": self.interrupted_turns,
                "bytes_sent": self.bytes_sent, "faults": self.faults,
                "end_of_run_partitions": self.end_of_run_partitions,
                "live_version_min": self.live_version_min, "live_version_max": self.live_version_max,
                "weight_waits": self.weight_waits, "weight_waited_s": round(self.weight_waited_s, 3)}

    def saw(self, gate: StalenessGate | None) -> None:
        """Take in what the gate saw (the live versions, the waits)."""
        if gate is not None:
            self.live_version_min, self.live_version_max = gate.lowest, gate.highest
            self.weight_waits, self.weight_waited_s = gate.waits, gate.waited_s


ProgressFn = Callable[[GenerateSummary], None]

BeforeFlush = Callable[[GenerateSummary, "tuple[Sample, dict] | None"], None]


def publish_turns(turns: Iterable[tuple[Sample, dict]], publisher, *, run_id: str = "", end_of_run: bool = True,
                  progress: ProgressFn | None = None, gate: StalenessGate | None = None,
                  before_flush: BeforeFlush | None = None) -> GenerateSummary:
    """Publish every turn; flush; close the run; return what was sent.

    ``publisher`` is a ``TurnPublisher`` (anything with ``publish_turn``, ``flush``,
    ``publish_end_of_run`` and ``bytes_sent``). ``gate``: the staleness bound the turns were made under.
    """
    summary = GenerateSummary(run_id=run_id or uuid.uuid4().hex)
    start_bytes = publisher.bytes_sent
    last_final: tuple[Sample, dict] | None = None
    for sample, args in turns:
        publisher.publish_turn(sample, **args)
        summary.turns_sent += 1
        summary.interrupted_turns += sample.status is Status.ABORTED
        summary.saw(gate)
        if args["final"]:
            summary.episodes.append((rollout_key_of(sample), args["attempt"]))
            last_final = last_final or (sample, args)
        summary.bytes_sent = publisher.bytes_sent - start_bytes
        if progress is not None:
            progress(summary)
    if before_flush is not None:
        before_flush(summary, last_final)
    publisher.flush()
    summary.bytes_sent = publisher.bytes_sent - start_bytes
    if end_of_run:
        summary.end_of_run_partitions = publisher.publish_end_of_run(summary.run_id)
    summary.saw(gate)
    logger.info("generated run=%s episodes=%d turns=%d bytes=%d faults=%d end_of_run_partitions=%d", summary.run_id,
                len(summary.episodes), summary.turns_sent, summary.bytes_sent, len(summary.faults),
                summary.end_of_run_partitions)
    if gate is not None:
        logger.info("weights run=%s live_version_min=%s live_version_max=%s waits=%d waited_s=%.1f", summary.run_id,
                    summary.live_version_min, summary.live_version_max, summary.weight_waits, summary.weight_waited_s)
    return summary
