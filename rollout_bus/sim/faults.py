"""Deliberately bad records (``inject_faults``), so a demo shows every path to the DLQ.

Contract: with ``inject_faults`` off nothing here changes what is sent. With it on:

* ``replay-gap``: the first episode of the first group (at least two turns when ``max_turns``
  allows) sends its final turn without a sampling mask: ``merge_samples`` starts a new segment
  there and the batch holding it fails the whole-batch mask check.
* ``finished``: after everything else, one more turn (turn = final turn + 1, same attempt, not
  final) for the first finished episode: a turn for an episode that is already over.
* ``malformed``: a value that is not a samples payload, with well-formed headers and a key of
  its own (a group index no generated episode uses), so it can only fail to decode.

``publish`` returns one JSON-ready dict per fault (``kind``, ``key``, ``attempt``, and ``turn`` for
the records it sends itself).
"""

from __future__ import annotations

import copy
import time

from rollout_bus.sim.episode import EpisodeId
from rollout_bus.config import GenerateSettings
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.model.sample import AdapterRef, Sample
from rollout_bus.wire.rollout_key import rollout_key_of, rollout_key_string

MALFORMED_VALUE = b"\x07\x00\x00\x00\x00\x00\x00\x00{broken this is not a samples payload"
MALFORMED_GROUP = 1_000_000


class FaultPlan:
    """Which deliberate faults a run injects, and sending the ones that are raw records."""

    def __init__(self, settings: GenerateSettings, first_adapter: AdapterRef | None) -> None:
        self.enabled = settings.inject_faults
        self.gap_key = rollout_key_string((first_adapter, "rollout", 0, 0))

    def replay_gap_for(self, ident: EpisodeId) -> bool:
        """Whether this episode's last turn goes out without its sampling mask."""
        first_adapter = ident.adapter is None or ident.adapter.slot == 0
        return self.enabled and first_adapter and ident.group_index == 0 and ident.index == 0

    def publish(self, publisher, finished: tuple[Sample, dict] | None, episodes: list[tuple[str, int]]) -> list[dict]:
        """Send the ``finished`` and ``malformed`` records; describe all faults of the run.

        ``finished`` is the first finished episode's final turn and its args; ``episodes`` the
        (key, attempt) of every finished episode.
        """
        faults = [{"kind": "replay-gap", "key": key, "attempt": attempt} for key, attempt in episodes
                  if key == self.gap_key]
        if finished is not None:
            sample, args = finished
            late = copy.copy(sample)
            publisher.publish_turn(late, turn=args["turn"] + 1, attempt=args["attempt"], final=False,
                                   group_size=args["group_size"])
            faults.append({"kind": "finished", "key": rollout_key_of(sample),
                           "attempt": args["attempt"], "turn": args["turn"] + 1})
        key = rollout_key_string((None, "rollout", MALFORMED_GROUP, 0))
        headers = TurnHeaders(turn=0, attempt=0, final=True, group_size=1, sent_at_ms=time.time_ns() // 1_000_000)
        publisher.send_raw(key.encode(), MALFORMED_VALUE, headers.to_kafka())
        faults.append({"kind": "malformed", "key": key, "attempt": 0, "turn": 0})
        return faults
