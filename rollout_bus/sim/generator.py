"""The built-in generator: seeded multi-turn episodes, sampled with real top-p/top-k math in torch.

Contract:

* ``iter_turns(settings)`` yields ``(sample, args)`` for every turn, where ``args`` holds the
  ``publish_turn`` keywords ``turn``, ``attempt``, ``final`` and ``group_size``; no Kafka is
  involved. The same settings (seed included) yield the same samples in the same order.
* ``ceil(episodes / n_samples_per_prompt)`` prompt groups, assigned to the adapters round-robin.
  ``group_index`` counts the step's prompt groups across adapters (group g goes to adapter g mod A),
  so a step batch's range of group indices is complete from the episodes alone; each adapter numbers
  its own ``index`` (= ``rollout_id``) from 0, because ids are local to each adapter's data source.
  The last group holds what is left over, and ``group_size`` is the number of episodes actually in
  the group.
* Order: groups one after another; inside a group the live episodes advance one turn per round
  and their turns come out in index order, as concurrent engine calls would. The steps of all of
  a round's rollouts are batched: one ``[B, V]`` policy call and one sampling op per step.
* ``publish_generated(settings, publisher, progress=...)`` sends all of it (plus the deliberate
  faults of ``inject_faults``), then, with ``end_of_run`` on, closes the run (``run_id``, or a
  fresh uuid hex) with ``publisher.publish_end_of_run`` once everything is acknowledged, and
  returns a ``GenerateSummary`` naming the run.
* With a ``gate`` (``rollout_bus.publish.staleness_gate.StalenessGate``: the staleness bound and the trainer's live
  version), ``iter_turns(settings, gate)`` calls ``gate.admit(group_index)`` before it starts each group
  (it may wait there for the trainer) and stamps each engine call with ``gate.current()``; without
  one every call carries ``policy_version`` and nothing waits. ``publish_generated(..., gate=gate)``
  puts the least and greatest live versions seen in the summary.
* ``torch_threads`` (when > 0) sets torch's intra-op threads while generating, restored after:
  the per-step ops are small, and thread hand-offs cost more than they give on a busy 2-core box.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout_bus.sim.environment import ToolEnvironment
from rollout_bus.sim.episode import Episode, EpisodeId, TurnDraft
from rollout_bus.sim.faults import FaultPlan
from rollout_bus.sim.interruption import interruption_point, split_turn
from rollout_bus.sim.policy import Policy
from rollout_bus.sim.sampling import SamplingParams, sample_tokens
from rollout_bus.publish.staleness_gate import StalenessGate
from rollout_bus.config import GenerateSettings
from rollout_bus.errors import ConfigError, must_be
from rollout_bus.model.sample import AdapterRef, Sample, Status
from rollout_bus.wire.rollout_key import rollout_key_of

logger = logging.getLogger(__name__)

_PROMPT_STREAM = 1 << 29
_ENGINE_STREAM = 1 << 28
_INTERRUPT_STREAM = 1 << 27


@dataclass(frozen=True)
class GroupSpec:
    """One prompt group: which adapter, its index in the step, how many episodes, its first sample index."""

    adapter: AdapterRef | None
    group_index: int
    size: int
    first_index: int


def parse_adapters(spec: str) -> list[AdapterRef | None]:
    """``"math,code"`` -> ``[AdapterRef("math", 0), AdapterRef("code", 1)]``; ``""`` -> ``[None]``."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if len(set(names)) != len(names):
        raise ConfigError(must_be("adapters", "distinct names", spec))
    return [AdapterRef(name, slot) for slot, name in enumerate(names)] or [None]


def plan_groups(settings: GenerateSettings) -> list[GroupSpec]:
    """Every prompt group, in publishing order.

    Group indices count the RL step's prompt groups across adapters (group g goes to adapter
    g mod A), so a step batch's range of group indices is complete from the episodes alone; each
    adapter's data source numbers its own samples (``index``/``rollout_id``) from 0.
    """
    n = settings.n_samples_per_prompt
    adapters = parse_adapters(settings.adapters)
    groups = []
    for g in range(math.ceil(settings.episodes / n)):
        local = g // len(adapters)
        size = min(n, settings.episodes - g * n)
        groups.append(GroupSpec(adapters[g % len(adapters)], g, size, local * n))
    return groups


def _check(settings: GenerateSettings) -> SamplingParams:
    if settings.min_response_len > settings.max_response_len:
        raise ConfigError(must_be("min_response_len", f"<= max_response_len={settings.max_response_len}",
                                  settings.min_response_len))
    return SamplingParams(settings.temperature, settings.top_p, settings.top_k)


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _engine_generator(settings: GenerateSettings, group: GroupSpec, round_: int) -> torch.Generator:
    slot = group.adapter.slot + 1 if group.adapter is not None else 0
    words = [settings.seed, slot, group.group_index, round_, _ENGINE_STREAM]
    seed = int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def _run_engine(policy: Policy, params: SamplingParams, drafts: list[TurnDraft], gen: torch.Generator) -> None:
    """Sample every draft's response, one batched policy step at a time."""
    while True:
        active = [d for d in drafts if d.needs_token]
        if not active:
            return
        prev, last, salt = torch.tensor([d.context() for d in active], dtype=torch.int64).unbind(1)
        draw = sample_tokens(policy.logits(prev, last, salt), params, gen)
        for i, draft in enumerate(active):
            draft.push(int(draw.tokens[i]), float(draw.log_probs[i]), draw.supports[i])


def _group_episodes(settings: GenerateSettings, group: GroupSpec, env: ToolEnvironment,
                    faults: FaultPlan, gate: StalenessGate | None = None,
                    round_version: Callable[[], int] | None = None) -> list[Episode]:
    slot = group.adapter.slot + 1 if group.adapter is not None else 0
    rng = np.random.default_rng([settings.seed, slot, group.group_index, _PROMPT_STREAM])
    name = group.adapter.name if group.adapter is not None else "base"
    prompt, tokens = env.prompt(rng, f"{name}/task-{group.group_index}")
    episodes = []
    for j in range(group.size):
        ident = EpisodeId(group.adapter, group.group_index, group.first_index + j, group.size)
        if gate is None:  # exactly as before: the same settings give the same samples
            episodes.append(Episode(ident, settings, env, prompt, tokens, replay_gap=faults.replay_gap_for(ident)))
        else:
            episodes.append(Episode(ident, settings, env, prompt, tokens, replay_gap=faults.replay_gap_for(ident),
                                    version_of=round_version))
    return episodes


def iter_turns(settings: GenerateSettings, gate: StalenessGate | None = None) -> Iterator[tuple[Sample, dict]]:
    """Every turn of every episode, in publishing order, as ``(sample, publish_turn kwargs)``; with a
    ``gate``, each group starts once the gate admits it and engine calls carry the live version."""
    params = _check(settings)
    faults = FaultPlan(settings, parse_adapters(settings.adapters)[0])
    with _torch_threads(settings.torch_threads):
        policy = Policy(settings.vocab_size, settings.seed, dim=settings.policy_dim)
        env = ToolEnvironment(settings.vocab_size)
        for group in plan_groups(settings):
            if gate is not None:
                gate.admit(group.group_index)
            started: list[int] = [settings.policy_version]  # the live version when the round began
            episodes = _group_episodes(settings, group, env, faults, gate, lambda: started[0])
            round_, shifts = 0, _TurnShifts()
            while live := [e for e in episodes if not e.done]:
                drafts = [e.begin_turn() for e in live]
                before = started[0] = gate.current() if gate is not None else settings.policy_version
                _run_engine(policy, params, drafts, _engine_generator(settings, group, round_))
                after = gate.current() if gate is not None else before  # new weights live by the round's end?
                for episode, draft in zip(live, drafts):
                    yield from shifts.emit(settings, episode, *episode.end_turn(draft), before, after)
                round_ += 1


class _TurnShifts:
    """Interrupted turns (``interrupt_prob``): a turn whose weights changed while it was generated is
    sent as its aborted part (the old version) and its continuation (the new one; see
    ``rollout_bus.sim.interruption``), so every later turn of that attempt moves up by one. A turn not cut
    keeps the version it started under: staleness is never understated."""

    def __init__(self) -> None:
        self.shift: dict[tuple[int, int], int] = {}  # (episode index, attempt) -> extra turns sent

    def emit(self, settings: GenerateSettings, episode: Episode, sample: Sample, args: dict,
             before: int, after: int) -> Iterator[tuple[Sample, dict]]:
        key = (episode.ident.index, args["attempt"])
        args = {**args, "turn": args["turn"] + self.shift.get(key, 0)}
        if after == before or settings.interrupt_prob <= 0:
            yield sample, args
            return
        rng = np.random.default_rng(episode.ident.seed_words(settings.seed, _INTERRUPT_STREAM, args["attempt"],
                                                             args["turn"]))
        at = interruption_point(sample, rng) if rng.random() < settings.interrupt_prob else None
        if at is None:
            yield sample, args
            return
        aborted, continuation = split_turn(sample, at, before, after)
        self.shift[key] = self.shift.get(key, 0) + 1
        yield aborted, {**args, "final": False}
        yield continuation, {**args, "turn": args["turn"] + 1}


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


def publish_generated(settings: GenerateSettings, publisher, progress: ProgressFn | None = None,
                      gate: StalenessGate | None = None) -> GenerateSummary:
    """Generate and publish everything; flush; return what was sent.

    ``publisher`` is a ``TurnPublisher`` (anything with ``publish_turn``, ``send_raw``, ``flush``,
    ``publish_end_of_run`` and ``bytes_sent``). ``progress`` is called with the running summary
    after every turn. ``gate``: the staleness bound (see ``iter_turns``).
    """
    summary = GenerateSummary(run_id=settings.run_id or uuid.uuid4().hex)
    start_bytes = publisher.bytes_sent
    last_final: tuple[Sample, dict] | None = None
    for sample, args in iter_turns(settings, gate):
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
    if settings.inject_faults:
        plan = FaultPlan(settings, parse_adapters(settings.adapters)[0])
        summary.faults = plan.publish(publisher, last_final, summary.episodes)
    publisher.flush()
    summary.bytes_sent = publisher.bytes_sent - start_bytes
    if settings.end_of_run:
        summary.end_of_run_partitions = publisher.publish_end_of_run(summary.run_id)
    summary.saw(gate)
    logger.info("generated run=%s episodes=%d turns=%d bytes=%d faults=%d end_of_run_partitions=%d", summary.run_id,
                len(summary.episodes), summary.turns_sent, summary.bytes_sent, len(summary.faults),
                summary.end_of_run_partitions)
    if gate is not None:
        logger.info("weights run=%s live_version_min=%s live_version_max=%s waits=%d waited_s=%.1f", summary.run_id,
                    summary.live_version_min, summary.live_version_max, summary.weight_waits, summary.weight_waited_s)
    return summary
