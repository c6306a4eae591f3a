"""A prompt group on rollout.prompts, and the events of its life on rollout.prompt_ledger (WIRE.md section 15).

Why: a user's own prompts are the work a group of generators shares. Each prompt group is one record, loaded once,
with everything a generator needs to make its ``n_samples`` episodes (the prompt's token ids, the label a reward
needs, the sampling parameters, the adapter) and the ``group_index`` fixed at load, so batch membership never
depends on which generator made it. Pure: builds and parses bytes, talks to no broker.

Contract:

* ``PromptGroup``: key ``id`` (UTF-8), value ``compact_json`` of its fields, header ``schema``. Built only valid
  (``ContractError`` naming the field). ``prompt_id(doc)`` is the id a loader gives a line without one: the
  sha256 of its canonical content, so loading the same file twice finds the same ids.
* ``LedgerEvent``: what became of one prompt group, keyed by its id (so its events share a partition and are
  in order): ``claimed`` (delivery ``d`` begun by ``generator``), ``done`` (every episode of delivery ``d``
  acknowledged on rollout.turns), ``failed`` (given up after ``d`` deliveries, ``reason`` says why); and, keyed
  ``LOADED_KEY``, ``loaded`` (a load finished: ``count`` new prompt groups, all acknowledged). A prompt group's
  deliveries count its ``claimed`` events: the count Kafka's share groups keep per record, kept here in the log.
  ``progress`` (one turn of delivery ``d`` acknowledged on rollout.turns: ``mark``, a ``TurnMark`` saying which
  episode, attempt and turn, and where the record is) is what a later delivery resumes from.
* ``PromptLedger`` folds the events: deliveries, ends, the loaded count, and per prompt group still in flight the
  progress of each episode (``EpisodeProgress``: the turns the log holds, in the stream stage's own terms, so a
  generator that takes the group over continues from where the stream will keep it; forgotten at the end).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_bus.errors import ContractError, must_be
from rollout_bus.wire.compact_json import compact_json
from rollout_bus.wire.headers import HEADER_SCHEMA, SCHEMA_VERSION
from rollout_bus.wire.record_fields import record_fields

LOADED_KEY = b"loaded"
EVENTS = ("claimed", "done", "failed", "loaded", "progress")
SAMPLING_KEYS = {"temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
                 "max_new_tokens": (int,)}


def prompt_id(content: dict[str, Any]) -> str:
    """The id of a prompt group given without one: ``p-`` and 24 hex digits of the sha256 of its content."""
    return "p-" + hashlib.sha256(compact_json(content)).hexdigest()[:24]


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class PromptGroup:
    """One prompt group: ``n_samples`` episodes to make from ``input_ids`` (see the module docstring)."""

    id: str
    group_index: int
    input_ids: list[int]
    n_samples: int
    label: Any = None
    metadata: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    adapter: str | None = None
    text: str | None = None  # the prompt as written (text, or the chat template's rendering), when it was text
    tokenizer: str | None = None  # which tokenizer made input_ids from it

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ContractError(must_be(f"prompt group field {problem[0]!r}", problem[1], problem[2]))

    def _problem(self) -> tuple[str, str, object] | None:
        if not isinstance(self.id, str) or not 1 <= len(self.id.encode()) <= 256:
            return "id", "a string of 1-256 bytes", self.id
        if not _is_int(self.group_index, 0):
            return "group_index", "an integer >= 0", self.group_index
        if not isinstance(self.input_ids, list) or not self.input_ids or not all(_is_int(t, 0) for t in self.input_ids):
            return "input_ids", "a non-empty list of token ids (integers >= 0)", str(self.input_ids)[:80]
        if not _is_int(self.n_samples, 1):
            return "n_samples", "an integer >= 1", self.n_samples
        if not isinstance(self.metadata, dict):
            return "metadata", "a JSON object", self.metadata
        if not isinstance(self.sampling, dict):
            return "sampling", "a JSON object", self.sampling
        for name, value in self.sampling.items():
            if name not in SAMPLING_KEYS or not isinstance(value, SAMPLING_KEYS[name]) or isinstance(value, bool):
                return f"sampling.{name}", f"one of {sorted(SAMPLING_KEYS)} with a number", value
        for name in ("adapter", "text", "tokenizer"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                return name, "a string or null", getattr(self, name)
        try:
            compact_json(self.label, allow_nan=False)
        except (TypeError, ValueError):  # TypeError: a value JSON has no spelling for (bytes, a date)
            return "label", "JSON without NaN or infinities", self.label
        return None

    def key(self) -> bytes:
        return self.id.encode()

    def value(self) -> bytes:
        return compact_json(asdict(self), allow_nan=False)

    @staticmethod
    def headers() -> list[tuple[str, bytes]]:
        return [(HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    @classmethod
    def from_value(cls, value: bytes | None) -> "PromptGroup":
        """Strict inverse of ``value``; ``ContractError`` naming the field otherwise."""
        doc = record_fields(value, "prompt group", {"id": str, "group_index": int, "input_ids": list,
                                                    "n_samples": int}, ())
        unknown = set(doc) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ContractError(must_be("prompt group", f"only the fields {sorted(cls.__dataclass_fields__)}",
                                        sorted(unknown)))
        return cls(**doc)


@dataclass(frozen=True)
class TurnMark:
    """One acknowledged turn of a prompt group's episode: episode ``sample`` (0..n_samples-1), its ``attempt`` and
    ``turn`` headers, ``final``, ``resumed`` (the turn carries the ``resumed`` header), and the record's place on
    rollout.turns (``partition``, ``offset``); ``observation``, when the episode's environment answered after this
    turn, its answer (token ids): the tool call it ran is then on the log before the next turn is, and a taker
    gives it back instead of running it again."""

    sample: int
    attempt: int
    turn: int
    final: bool
    resumed: bool
    partition: int
    offset: int
    observation: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("sample", "attempt", "turn", "partition", "offset"):
            if not _is_int(getattr(self, name), 0):
                raise ContractError(must_be(f"progress mark field {name!r}", "an integer >= 0", getattr(self, name)))
        for name in ("final", "resumed"):
            if not isinstance(getattr(self, name), bool):
                raise ContractError(must_be(f"progress mark field {name!r}", "true or false", getattr(self, name)))
        if self.observation is not None:
            if not isinstance(self.observation, (list, tuple)) or not all(_is_int(t, 0) for t in self.observation):
                raise ContractError(must_be("progress mark field 'observation'", "a list of token ids (integers >= 0)",
                                            self.observation))
            object.__setattr__(self, "observation", tuple(self.observation))

    def doc(self) -> dict[str, Any]:
        """The mark as the event's JSON has it: ``observation`` only when there is one."""
        doc = asdict(self)
        if self.observation is None:
            del doc["observation"]
        else:
            doc["observation"] = list(self.observation)
        return doc

    @classmethod
    def from_doc(cls, doc: Any) -> "TurnMark":
        required = set(cls.__dataclass_fields__) - {"observation"}
        if not isinstance(doc, dict) or not required <= set(doc) <= set(cls.__dataclass_fields__):
            raise ContractError(must_be("ledger event field 'mark'", f"an object of {sorted(required)} (and "
                                        "optionally 'observation')", doc))
        return cls(**doc)


@dataclass(frozen=True)
class EpisodeProgress:
    """What the log holds of one episode of a prompt group in flight: the delivery and attempt it is at, and its
    turns 0..n-1 (``marks``); ``finished`` once the last is final."""

    delivery: int
    attempt: int
    marks: tuple[TurnMark, ...]

    @property
    def finished(self) -> bool:
        return bool(self.marks) and self.marks[-1].final

    @property
    def answers_logged(self) -> int:
        """How many of the environment's answers (tool calls) the log holds: the one between each two logged turns,
        and the one noted with the last; the calls a taker gives back instead of running (steps 1..this)."""
        if not self.marks:
            return 0
        return len(self.marks) - 1 + (self.marks[-1].observation is not None)

    def then(self, delivery: int, mark: TurnMark) -> "EpisodeProgress":
        """The progress after ``mark`` of ``delivery`` is acknowledged, as the stream stage decides (WIRE.md 4.2):
        a lower delivery is fenced, a higher one takes over at turn 0 or resumes with the turns below its
        ``resumed`` turn; within a delivery a higher attempt starts again at turn 0, the next turn extends it.
        A mark that fits none of these (it cannot be merged) leaves the progress as it was."""
        if self.finished or delivery < self.delivery:
            return self
        if mark.turn == 0 and (delivery > self.delivery or mark.attempt > self.attempt):
            return EpisodeProgress(delivery, mark.attempt, (mark,))
        if mark.attempt != self.attempt:
            return self
        if delivery > self.delivery and mark.resumed and mark.turn <= len(self.marks):
            return EpisodeProgress(delivery, mark.attempt, self.marks[:mark.turn] + (mark,))
        if delivery == self.delivery and mark.turn == len(self.marks):
            return EpisodeProgress(delivery, mark.attempt, self.marks + (mark,))
        return self


@dataclass(frozen=True)
class LedgerEvent:
    """One event of a prompt group's life (or a finished load), on rollout.prompt_ledger."""

    event: str
    prompt: str = ""  # the prompt group's id ("" for ``loaded``)
    delivery: int = 0  # 1 for the first delivery; ``failed``: how many there were
    generator: str = ""
    reason: str = ""
    count: int = 0  # ``loaded``: how many new prompt groups the load added
    mark: TurnMark | None = None  # ``progress`` only: the turn acknowledged

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ContractError(must_be("ledger event", " or ".join(EVENTS), self.event))
        if (self.event == "loaded") == bool(self.prompt):
            raise ContractError(must_be(f"ledger event {self.event!r} field 'prompt'",
                                        "empty" if self.event == "loaded" else "a prompt group id", self.prompt))
        if not _is_int(self.delivery, 0) or not _is_int(self.count, 0):
            raise ContractError(must_be("ledger event delivery and count", "integers >= 0",
                                        (self.delivery, self.count)))
        if (self.event == "progress") != (self.mark is not None):
            raise ContractError(must_be(f"ledger event {self.event!r} field 'mark'",
                                        "a turn mark" if self.event == "progress" else "absent", self.mark))

    def key(self) -> bytes:
        return LOADED_KEY if self.event == "loaded" else self.prompt.encode()

    @staticmethod
    def headers() -> list[tuple[str, bytes]]:
        return [(HEADER_SCHEMA, SCHEMA_VERSION.encode())]

    def value(self) -> bytes:
        doc = asdict(self)
        if self.mark is None:
            del doc["mark"]  # the six fields every event has; only progress carries a seventh
        else:
            doc["mark"] = self.mark.doc()
        return compact_json(doc)

    @classmethod
    def from_value(cls, value: bytes | None) -> "LedgerEvent":
        doc = record_fields(value, "ledger event", {"event": str, "prompt": str, "delivery": int, "generator": str,
                                                    "reason": str, "count": int}, ())
        mark = TurnMark.from_doc(doc.get("mark")) if doc.get("event") == "progress" else None
        return cls(**{name: doc[name] for name in cls.__dataclass_fields__ if name != "mark"}, mark=mark)


@dataclass
class PromptLedger:
    """What the ledger says, folded: per prompt group its deliveries and end (``done``/``failed``), and how many
    prompt groups finished loads added. ``take(event)`` folds one more in."""

    deliveries: dict[str, int] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)  # prompt id -> "done" | "failed"
    reasons: dict[str, str] = field(default_factory=dict)  # failed prompt id -> why
    loaded: int = 0
    claimant: dict[str, str] = field(default_factory=dict)  # prompt id -> the generator of its latest delivery
    # prompt id (in flight) -> episode (sample) -> what the log holds of it; dropped when the group ends
    progress: dict[str, dict[int, EpisodeProgress]] = field(default_factory=dict)

    def take(self, event: LedgerEvent) -> None:
        if event.event == "progress":
            if event.prompt not in self.ended and event.mark is not None:
                episodes = self.progress.setdefault(event.prompt, {})
                held = episodes.get(event.mark.sample)
                if held is None:
                    held = EpisodeProgress(0, 0, ())
                episodes[event.mark.sample] = held.then(event.delivery, event.mark)
        elif event.event == "loaded":
            self.loaded += event.count
        elif event.event == "claimed":
            if event.delivery >= self.deliveries.get(event.prompt, 0):
                self.claimant[event.prompt] = event.generator
            self.deliveries[event.prompt] = max(self.deliveries.get(event.prompt, 0), event.delivery)
        else:
            self.ended.setdefault(event.prompt, event.event)
            self.progress.pop(event.prompt, None)
            if event.event == "failed":
                self.reasons.setdefault(event.prompt, event.reason)

    def counts(self) -> dict[str, int]:
        """The prompt ledger: loaded, done, failed, in flight (claimed, not ended), redelivered (more than one
        delivery)."""
        ends = list(self.ended.values())
        return {"loaded": self.loaded, "done": ends.count("done"), "failed": ends.count("failed"),
                "in_flight": sum(1 for p in self.deliveries if p not in self.ended),
                "redelivered": sum(1 for d in self.deliveries.values() if d > 1)}

    def part_way(self) -> list[tuple[str, str, int]]:
        """(generator, prompt id, logged turns) of each prompt group in flight with turns of unfinished episodes on
        the log: what a generator killed now would leave for its taker to resume (drills aim their kills by it)."""
        found = []
        for prompt, episodes in self.progress.items():
            turns = sum(len(e.marks) for e in episodes.values() if not e.finished)
            if turns and prompt not in self.ended and prompt in self.claimant:
                found.append((self.claimant[prompt], prompt, turns))
        return found

    def all_ended(self) -> bool:
        """Every prompt group the finished loads added is done or failed (and at least one was loaded)."""
        return self.loaded > 0 and len(self.ended) >= self.loaded
