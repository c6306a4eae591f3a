"""The flow record on rollout.metrics and every flow metric name (``rollout/flow/...``): the one home of both.

Why: asynchronous RL trades the generators' idle time (held back by the staleness bound) against the
trainer's (starved of batches), and a run can be healthy by every count and still waste its fleet (old
samples, tokens that never train). The generator, the trainer and the shard writer write these names;
the tail view, the exporter, the report and the demo read them. Each name is spelled here once and
imported by both sides, so a writer and a reader cannot drift apart (``tests/unit/wire/
test_one_home_per_name.py`` fails on a flow key spelled as a literal anywhere else).

Contract (keys without the ``rollout/`` prefix, which ``metrics_records.prefixed`` adds; floats; fractions
of ``elapsed_s``, 0.0 when it is 0):

* ``flow_metrics_record(stage, source, metrics, elapsed_s=, final=)``: a generator's or a trainer's flow
  since it started (``FLOW_STAGES``), key ``flow_key(stage, source)``.
* ``generator_flow(blocked_s, waits, elapsed_s)``: ``GATE_BLOCKED_S`` (seconds the staleness gate held
  groups back), ``GATE_BLOCKED_FRACTION``, ``GATE_WAITS``; a member of the generator group
  (``--from-prompts``) adds, with ``resumed=ResumeCounts(...)``, what resuming taken-over prompt groups from the
  log saved: ``RESUMED_EPISODES`` (continued past turn 0), ``REUSED_EPISODES`` (found finished), ``REUSED_TURNS``
  and ``REUSED_TOKENS`` (turns and response tokens the log held, not made again). The tokens made again
  after all (what a takeover threw away) are the batches' ``discarded_tokens(CAUSE_TAKEOVER)``.
* ``trainer_flow(waited_s, steps, elapsed_s)``: ``TRAINER_WAIT_S`` (seconds spent waiting for the next
  batch), ``TRAINER_WAIT_FRACTION``, ``TRAINER_STEPS``. ``WAIT_KEYS`` names each stage's three.
* A batch's flow (the shard writer's ``consumers.shard_writer.flow.batch_flow``): ``SAMPLE_AGE_KEYS``
  (``flow/sample_age_s/{p50,p99,max}``), ``RESPONSE_TOKENS``, and per cause of ``DISCARD_CAUSES``
  ``discarded_tokens(cause)`` and ``discarded_token_fraction(cause)``, plus the unscoped
  ``discarded_token_fraction()``, their sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rollout_bus.errors import ContractError, must_be
from rollout_bus.wire.compact_json import compact_json
from rollout_bus.wire.metrics_records import prefixed

STAGE_GENERATOR, STAGE_TRAINER = "generator", "trainer"
FLOW_STAGES = (STAGE_GENERATOR, STAGE_TRAINER)

FLOW_PREFIX = "flow/"  # every flow key starts with it (after ``rollout/`` once published)
GATE_BLOCKED_S = "flow/generator/gate_blocked_s"
GATE_BLOCKED_FRACTION = "flow/generator/gate_blocked_fraction"
GATE_WAITS = "flow/generator/gate_waits"
RESUMED_EPISODES = "flow/generator/resumed_episodes"
REUSED_EPISODES = "flow/generator/reused_episodes"
REUSED_TURNS = "flow/generator/reused_turns"
REUSED_TOKENS = "flow/generator/reused_tokens"
TRAINER_WAIT_S = "flow/trainer/wait_s"
TRAINER_WAIT_FRACTION = "flow/trainer/wait_fraction"
TRAINER_STEPS = "flow/trainer/steps"

SAMPLE_AGE_P50 = "flow/sample_age_s/p50"  # seconds from an episode's final turn to its batch written
SAMPLE_AGE_P99 = "flow/sample_age_s/p99"
SAMPLE_AGE_MAX = "flow/sample_age_s/max"
SAMPLE_AGE_KEYS = (SAMPLE_AGE_P50, SAMPLE_AGE_P99, SAMPLE_AGE_MAX)
RESPONSE_TOKENS = "flow/response_tokens"
INCOMPLETE_GROUPS = "flow/incomplete_groups"  # groups the batch holds short: the run ended without their members
DISCARDED_TOKENS = "flow/discarded_tokens/"  # + cause
DISCARDED_TOKEN_FRACTION = "flow/discarded_token_fraction"  # the sum; + "/" + cause for one cause

# Why a response token never trains: its sample was aborted, or removed (``remove_sample``) otherwise, or its
# episode was dropped as stale (and dead-lettered as ``stale``), or a generator takeover threw it away (the stored
# turns of a dead generator's delivery of the episode, discarded when a higher delivery made it again).
CAUSE_ABORTED, CAUSE_REMOVED, CAUSE_STALE, CAUSE_TAKEOVER = "aborted", "removed", "stale", "takeover"
DISCARD_CAUSES = (CAUSE_ABORTED, CAUSE_REMOVED, CAUSE_STALE, CAUSE_TAKEOVER)


def discarded_tokens(cause: str) -> str:
    """``flow/discarded_tokens/{cause}``."""
    return f"{DISCARDED_TOKENS}{cause}"


def discarded_token_fraction(cause: str | None = None) -> str:
    """``flow/discarded_token_fraction/{cause}``, or the unscoped sum's key without a cause."""
    return DISCARDED_TOKEN_FRACTION if cause is None else f"{DISCARDED_TOKEN_FRACTION}/{cause}"


class WaitKeys(NamedTuple):
    """One stage's wait keys: seconds waited, their fraction of the stage's time, and what it counts."""

    seconds: str
    fraction: str
    count: str


WAIT_KEYS = {STAGE_GENERATOR: WaitKeys(GATE_BLOCKED_S, GATE_BLOCKED_FRACTION, GATE_WAITS),
             STAGE_TRAINER: WaitKeys(TRAINER_WAIT_S, TRAINER_WAIT_FRACTION, TRAINER_STEPS)}


def flow_key(stage: str, source: str) -> bytes:
    """The key of one source's flow records: ``flow:{stage}:{source}`` (ASCII)."""
    return f"flow:{stage}:{source}".encode("ascii", "replace")


def flow_metrics_record(stage: str, source: str, metrics: dict[str, Any], *, elapsed_s: float, final: bool) -> bytes:
    """A generator's or a trainer's flow since it started: ``metrics`` (keys without ``rollout/``) are totals
    over ``elapsed_s`` seconds, so the latest record of a (stage, source) is all a reader needs; ``final``
    on the last one, sent as it ends."""
    if stage not in FLOW_STAGES:
        raise ContractError(must_be("stage", f"one of {', '.join(FLOW_STAGES)}", stage))
    doc = {"kind": "flow", "stage": stage, "source": source, "elapsed_s": round(float(elapsed_s), 3),
           "final": bool(final), "metrics": prefixed(metrics)}
    return compact_json(doc)


def _fraction(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0


class ResumeCounts(NamedTuple):
    """What a member of the generator group kept of taken-over prompt groups (see the module docstring)."""

    resumed_episodes: int
    reused_episodes: int
    reused_turns: int
    reused_tokens: int


def generator_flow(blocked_s: float, waits: int, elapsed_s: float,
                   resumed: ResumeCounts | None = None) -> dict[str, float]:
    flow = {GATE_BLOCKED_S: float(blocked_s), GATE_BLOCKED_FRACTION: _fraction(blocked_s, elapsed_s),
            GATE_WAITS: float(waits)}
    if resumed is not None:
        flow.update({RESUMED_EPISODES: float(resumed.resumed_episodes), REUSED_EPISODES: float(resumed.reused_episodes),
                     REUSED_TURNS: float(resumed.reused_turns), REUSED_TOKENS: float(resumed.reused_tokens)})
    return flow


def trainer_flow(waited_s: float, steps: int, elapsed_s: float) -> dict[str, float]:
    return {TRAINER_WAIT_S: float(waited_s), TRAINER_WAIT_FRACTION: _fraction(waited_s, elapsed_s),
            TRAINER_STEPS: float(steps)}
