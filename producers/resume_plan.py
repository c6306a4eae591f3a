"""What a generator that takes a prompt group over keeps of the episodes the log already holds.

Why: an episode is many turns, each an engine call (and a tool call) of seconds; a generator that dies costs a
fleet all of them unless the next delivery continues from what was published. The ledger's ``progress`` events
say, per episode, which turns the log holds (``rollout_bus.wire.prompt_record.EpisodeProgress``, folded as the
stream stage decides), and where; the records themselves are read back from rollout.turns by offset. Pure:
the caller reads the ledger and fetches the records.

Contract:

* ``ResumePlan.of(prompt, progress, records)``: ``progress`` maps an episode (sample ``j``) to its
  ``EpisodeProgress``, ``records`` the fetched turn records by (partition, offset). An episode keeps the turns
  whose records were found, from turn 0 up to the first that is missing (``missing`` names the rest: the log no
  longer holds them, retention; said loudly by the caller, and they are made again).
* ``logged`` maps each episode to its ``Logged`` turns, decoded (turn 0 up, of the attempt the log holds,
  whether the last is final, and the environment's answer after the last when its mark noted one): an engine
  continues from them (a real engine: from their tokens, its environment given back the observations between
  them, never executed again) or makes them again without its latency (the seeded engine, to reach the same
  draws). A record that does not decode counts as missing.
* ``take(j, sample, args, value)``, for each turn the engine makes in order (``value``: its encoded payload),
  says what to do with it: ``REUSE`` (the log holds this very turn, byte for byte and as final or not: not sent
  again), ``RESUME``
  (the first turn sent for an episode that continues past turn 0: sent with the ``resumed`` header, the turns
  below it kept) or ``SEND``. An engine whose turn differs from the logged one (another engine, other weights)
  continues from the last turn that matched: that one and what follows are sent. Turns of an attempt below the
  logged one were superseded on the log: not sent (and not counted as reused).
* ``env_answer(env, so_far, logged, k, made=None)``: the environment's answer after turn ``k``, given back from
  the log (``Logged.observation_after``: the next logged turn's forced tokens, or the last one's noted answer)
  with ``env.record`` when it is there, else ``env.step``: a tool whose answer is on the log never runs again.
* Counts for the generator's summary: ``reused_turns``, ``reused_tokens``, ``resumed_episodes`` (continued past
  turn 0), ``reused_episodes`` (found finished).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import Sample
from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.prompt_record import EpisodeProgress, PromptGroup


@dataclass(frozen=True)
class Logged:
    """An episode's turns the log holds, decoded: turn 0 up, of ``attempt``; ``finished``: the last one is final;
    ``observation``: the environment's answer after the last one, when its mark noted one."""

    attempt: int
    turns: tuple[Sample, ...]
    finished: bool
    observation: tuple[int, ...] | None = None

    def observation_after(self, k: int, made: Sample | None = None) -> list[int] | None:
        """The environment's answer after logged turn ``k``, if the log holds it (the next turn's forced tokens,
        or the last turn's noted answer), else None; with ``made``, only if that turn is the logged one (same
        tokens: an engine that made it again the same way)."""
        if not 0 <= k < len(self.turns) or (made is not None and list(made.tokens) != list(self.turns[k].tokens)):
            return None
        if k + 1 < len(self.turns):
            return observation_between(self.turns[k], self.turns[k + 1])
        return list(self.observation) if self.observation is not None else None


def env_answer(env: Any, so_far: Sample, logged: Logged | None, k: int,
               made: Sample | None = None) -> list[int] | None:
    """The environment's answer after turn ``k`` of an episode (``so_far``: the episode up to it): given back from
    the log when it holds it (``env.record``: the tool is not run again), else ``env.step`` (None: the episode is
    over)."""
    known = logged.observation_after(k, made) if logged is not None else None
    if known is not None:
        env.record(so_far, known)
        return known
    return env.step(so_far)


def observation_between(turn: Sample, following: Sample) -> list[int]:
    """The tokens forced between two logged turns (an environment's answer): what the next turn's context adds to
    the previous turn's tokens. ``[]`` when the next turn does not extend it (a compacted history)."""
    before = len(turn.tokens)
    context = len(following.tokens) - int(following.response_length)
    if context < before or list(following.tokens[:before]) != list(turn.tokens):
        return []
    return [int(t) for t in following.tokens[before:context]]


class TurnFate(str, Enum):
    REUSE = "reuse"
    RESUME = "resume"
    SEND = "send"


@dataclass
class _Episode:
    attempt: int
    values: list[bytes]  # the logged turns' payloads, turn 0 up
    turns: list[Sample]  # the same, decoded
    finished: bool
    observation: tuple[int, ...] | None  # the environment's answer after the last one, when noted
    diverged: bool = False
    sent: bool = False


@dataclass
class ResumePlan:
    """Per episode of one prompt group, the turns the log holds (see the module docstring)."""

    episodes: dict[int, _Episode] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # "episode j turn t at partition:offset", for the caller
    reused_turns: int = 0
    reused_tokens: int = 0
    resumed_episodes: int = 0
    reused_episodes: int = 0

    @classmethod
    def of(cls, prompt: PromptGroup, progress: Mapping[int, EpisodeProgress],
           records: Mapping[tuple[int, int], Any]) -> "ResumePlan":
        plan = cls()
        for j, held in sorted(progress.items()):
            if not 0 <= j < prompt.n_samples or not held.marks:
                continue
            values, turns = [], []
            for mark in held.marks:
                record = records.get((mark.partition, mark.offset))
                value = bytes(record.value or b"") if record is not None else b""
                try:
                    [turn], _ = decode_samples(value, TURN_FIELDS) if record is not None else ([None], None)
                except (ContractError, ValueError):
                    turn = None
                if turn is None:
                    plan.missing.append(f"episode {j} turn {mark.turn} at {mark.partition}:{mark.offset}")
                    break
                values.append(value)
                turns.append(turn)
            if values:
                whole = len(values) == len(held.marks)
                plan.episodes[j] = _Episode(held.attempt, values, turns, held.finished and whole,
                                            held.marks[-1].observation if whole else None)
        return plan

    @property
    def logged(self) -> dict[int, Logged]:
        return {j: Logged(e.attempt, tuple(e.turns), e.finished, e.observation) for j, e in self.episodes.items()}

    def take(self, j: int, sample: Sample, args: Mapping[str, Any], value: bytes) -> TurnFate:
        episode = self.episodes.get(j)
        if episode is None:
            return TurnFate.SEND
        attempt, turn = args.get("attempt", 0), args["turn"]
        if not episode.diverged and not episode.sent:
            if attempt < episode.attempt:  # superseded on the log already: not sent, not counted as reused
                return TurnFate.REUSE
            last = turn == len(episode.values) - 1
            if (attempt == episode.attempt and turn < len(episode.values) and value == episode.values[turn]
                    and bool(args["final"]) == (episode.finished and last)):
                if args["final"]:
                    self.reused_episodes += 1
                return self._reused(sample)
            episode.diverged = True
        first = not episode.sent
        episode.sent = True
        if first and turn > 0 and attempt == episode.attempt and turn <= len(episode.values):
            self.resumed_episodes += 1
            return TurnFate.RESUME
        return TurnFate.SEND

    def _reused(self, sample: Sample) -> TurnFate:
        self.reused_turns += 1
        self.reused_tokens += int(sample.response_length)
        return TurnFate.REUSE
