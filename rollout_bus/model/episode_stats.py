"""The exact, mergeable episode-metric accumulator (docs/data-model.md section 6).

Contract:

* Episodes are told apart by ``model.sample.get_rollout_key`` (``(adapter, kind, group_index, id)``):
  compaction siblings share a key; the same id in another prompt group or under another adapter is
  another episode.
* The episode-length and reward parts of ``rollout_bus.model.metrics`` are computed here, from small
  exact summaries that both the batch functions and ``EpisodeStats`` build, so the two agree
  bit for bit:

  - lengths: a histogram ``{trainable episode length: episodes}`` and the exact integer sum of
    total episode lengths, per scope (``None`` = adapter-less, else the adapter's name);
  - rewards: the exact ``Fraction`` sum of per-rollout mean rewards and the number of rollouts
    that had a numeric reward, for all rollouts and per adapter name.

* Rewards: numeric as ``sample.reward_number`` says (the rule ``train_data`` follows too): a bool
  (numpy's too) as 0 or 1, an int, or a finite float. NaN, infinities, None, dicts and strings
  are skipped. The source is ``metadata["raw_reward"]`` for every sample when the *first sample of
  the batch* has that key, else ``reward`` (miles' rule); a sample lacking the chosen source has
  no reward.
* ``EpisodeStats`` accumulates finished episodes for a stream window. ``metrics()`` equals the
  episode-length and reward keys of ``compute_metrics_from_samples`` over the concatenated
  segments of the episodes, in the order added, exactly (same integers, same Fractions, one
  final rounding). This holds as long as no rollout key spans two ``add_episode`` calls (the
  stream stage emits each episode once). Its size grows with distinct lengths, not episodes.
* ``merge(other)`` returns a new accumulator, equal to adding self's episodes then other's;
  inputs are unchanged. It is associative, and commutative whenever both sides use the same
  reward source (or one is empty): the first episode picks the source, as the first sample of a
  batch does, so mixing generators that disagree is order-dependent here exactly as in a batch.
* ``to_json()`` is compact and deterministic; ``EpisodeStats.from_json`` is strict and raises
  ``ContractError`` on anything ``to_json`` would not write.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any


from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import Sample, get_rollout_key, reward_number

Scope = str | None
SOURCES = ("metadata", "reward")
_JSON_VERSION = 1
_FRACTION = re.compile(r"-?[0-9]+/[0-9]+")


def adapter_scope(sample: Sample) -> Scope:
    """Metric scope of a sample: its adapter's name (slots of one name pool), or None."""
    return sample.adapter.name if sample.adapter is not None else None


def reward_source(first: Sample) -> str:
    """miles' rule: the batch's first sample says whether rewards come from metadata."""
    metadata = first.metadata
    return "metadata" if isinstance(metadata, Mapping) and "raw_reward" in metadata else "reward"


def numeric_reward(value: Any) -> Fraction | None:
    """The exact value of a reward that counts (``sample.reward_number``), or None."""
    number = reward_number(value)
    return None if number is None else Fraction(number)


def rollout_reward(segments: Iterable[Sample], source: str) -> Fraction | None:
    """Exact mean of one rollout's numeric rewards under ``source``; None if it has none."""
    values = []
    for sample in segments:
        if source == "metadata":
            metadata = sample.metadata
            raw = metadata.get("raw_reward") if isinstance(metadata, Mapping) else None
        else:
            raw = sample.reward
        value = numeric_reward(raw)
        if value is not None:
            values.append(value)
    return sum(values, Fraction(0)) / len(values) if values else None


def episode_lengths(segments: Iterable[Sample]) -> tuple[int, int]:
    """(trainable, total) tokens of one episode: removed segments train on nothing."""
    trainable = total = 0
    for sample in segments:
        total += int(sample.response_length)
        if not sample.remove_sample:
            trainable += int(sample.effective_response_length)
    return trainable, total


class LengthHistogram:
    """Per-episode trainable lengths as ``{length: episodes}`` plus the sum of total lengths."""

    def __init__(self, counts: Mapping[int, int] | None = None, total: int = 0) -> None:
        self.counts: Counter[int] = Counter(counts or {})
        self.total = total

    @property
    def episodes(self) -> int:
        return sum(self.counts.values())

    def add(self, trainable: int, total: int) -> None:
        self.counts[trainable] += 1
        self.total += total

    def merged(self, other: LengthHistogram) -> LengthHistogram:
        return LengthHistogram(self.counts + other.counts, self.total + other.total)

    def metrics(self, prefix: str) -> dict[str, float]:
        """numpy's mean/median/max/min of the lengths, computed exactly from the counts."""
        items = sorted(self.counts.items())
        n = self.episodes
        return {
            f"{prefix}episode_response_length/mean": sum(length * count for length, count in items) / n,
            f"{prefix}episode_response_length/median": _histogram_median(items, n),
            f"{prefix}episode_response_length/max": float(items[-1][0]),
            f"{prefix}episode_response_length/min": float(items[0][0]),
            f"{prefix}episode_total_response_length/mean": self.total / n,
        }


def _histogram_median(items: Sequence[tuple[int, int]], n: int) -> float:
    """Average of the two middle values for an even count, as ``numpy.median``."""
    low_position, high_position = (n - 1) // 2, n // 2
    low = None
    seen = 0
    for length, count in items:
        if low is None and seen + count > low_position:
            low = length
        if seen + count > high_position:
            return (low + length) / 2
        seen += count
    raise ContractError(must_be("histogram", "non-empty", dict(items)))


class RewardMean:
    """Exact running mean over rollouts of their mean reward."""

    def __init__(self, total: Fraction = Fraction(0), rollouts: int = 0) -> None:
        self.total = total
        self.rollouts = rollouts

    def add(self, value: Fraction) -> None:
        self.total += value
        self.rollouts += 1

    def merged(self, other: RewardMean) -> RewardMean:
        return RewardMean(self.total + other.total, self.rollouts + other.rollouts)

    def value(self) -> float:
        """One rounding at the end, so summation order cannot change the result."""
        return float(self.total / self.rollouts) if self.rollouts else 0.0


def length_metrics(histograms: Mapping[Scope, LengthHistogram]) -> dict[str, float]:
    """Unscoped keys without adapters; with any adapter, per-adapter keys only."""
    if any(scope is not None for scope in histograms):
        result: dict[str, float] = {}
        for name in sorted(scope for scope in histograms if scope is not None):
            result |= histograms[name].metrics(f"adapter/{name}/")
        return result
    histogram = histograms.get(None)
    return histogram.metrics("") if histogram is not None and histogram.episodes else {}


def reward_metrics(means: Mapping[Scope, RewardMean], adapter_names: Iterable[str]) -> dict[str, float]:
    """``episode_raw_reward`` over all rollouts, plus one per adapter when adapters exist."""
    result = {"episode_raw_reward": means.get(None, RewardMean()).value()}
    for name in sorted(adapter_names):
        result[f"adapter/{name}/episode_raw_reward"] = means.get(name, RewardMean()).value()
    return result


def add_rollout_reward(means: dict[Scope, RewardMean], scope: Scope, value: Fraction | None) -> None:
    """Count a rollout's reward in the all-rollouts mean and in its adapter's."""
    if value is None:
        return
    means.setdefault(None, RewardMean()).add(value)
    if scope is not None:
        means.setdefault(scope, RewardMean()).add(value)


class EpisodeStats:
    """Windowed episode metrics for the stream stage: small, exact, mergeable, serialisable."""

    def __init__(self) -> None:
        self._source: str | None = None
        self._lengths: dict[Scope, LengthHistogram] = {}
        self._rewards: dict[str, dict[Scope, RewardMean]] = {source: {} for source in SOURCES}

    @property
    def episodes(self) -> int:
        """Finished episodes added so far, every adapter included."""
        return sum(histogram.episodes for histogram in self._lengths.values())

    def add_episode(self, segments: Sequence[Sample]) -> None:
        """Add one finished episode: its sibling segments, which must share one rollout key."""
        segments = list(segments)
        _check_one_episode(segments)
        scope = adapter_scope(segments[0])
        if self._source is None:
            self._source = reward_source(segments[0])
        self._lengths.setdefault(scope, LengthHistogram()).add(*episode_lengths(segments))
        for source in SOURCES:
            add_rollout_reward(self._rewards[source], scope, rollout_reward(segments, source))

    def merge(self, other: EpisodeStats) -> EpisodeStats:
        """A new accumulator: self's episodes, then other's. Neither input changes."""
        if not isinstance(other, EpisodeStats):
            raise ContractError(must_be("other", "an EpisodeStats", type(other).__name__))
        merged = EpisodeStats()
        merged._source = self._source if self._source is not None else other._source
        merged._lengths = _merge_scoped(self._lengths, other._lengths)
        merged._rewards = {s: _merge_scoped(self._rewards[s], other._rewards[s]) for s in SOURCES}
        return merged

    def metrics(self) -> dict[str, float]:
        """The episode-length and reward keys ``compute_metrics_from_samples`` gives these episodes."""
        adapter_names = [scope for scope in self._lengths if scope is not None]
        rewards = self._rewards[self._source or "reward"]
        return length_metrics(self._lengths) | reward_metrics(rewards, adapter_names)

    def to_json(self) -> str:
        """Compact, deterministic JSON (sorted keys, exact fractions as ``"num/den"`` strings)."""
        document = {
            "version": _JSON_VERSION,
            "source": self._source,
            "lengths": [_length_entry(scope, h) for scope, h in _sorted_scopes(self._lengths)],
            "rewards": {
                source: [[scope, _fraction_text(m.total), m.rollouts] for scope, m in _sorted_scopes(means)]
                for source, means in self._rewards.items()
            },
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> EpisodeStats:
        """Rebuild from ``to_json`` output; anything else raises ContractError."""
        document = _load_document(text)
        stats = cls()
        stats._lengths = _parse_lengths(document["lengths"])
        stats._rewards = {source: _parse_rewards(document["rewards"], source) for source in SOURCES}
        stats._source = document["source"]
        _check_consistent(stats)
        return stats

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EpisodeStats):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"EpisodeStats(episodes={self.episodes}, source={self._source!r})"


def _check_one_episode(segments: list[Sample]) -> None:
    if not segments:
        raise ContractError(must_be("segments", "a non-empty list of one episode's samples", segments))
    for position, sample in enumerate(segments):
        if not isinstance(sample, Sample):
            raise ContractError(must_be(f"segments[{position}]", "a Sample", type(sample).__name__))
    keys = {get_rollout_key(sample, position) for position, sample in enumerate(segments)}
    if len(keys) != 1:
        raise ContractError(
            must_be("segments", "one episode (every segment with the same rollout key)", sorted(map(repr, keys)))
        )


def _merge_scoped(left: Mapping[Scope, Any], right: Mapping[Scope, Any]) -> dict[Scope, Any]:
    merged = dict(left)
    for scope, value in right.items():
        merged[scope] = merged[scope].merged(value) if scope in merged else value
    return merged


def _sorted_scopes(scoped: Mapping[Scope, Any]) -> list[tuple[Scope, Any]]:
    return sorted(scoped.items(), key=lambda item: (item[0] is not None, item[0] or ""))


def _length_entry(scope: Scope, histogram: LengthHistogram) -> list[Any]:
    return [scope, [[length, count] for length, count in sorted(histogram.counts.items())], histogram.total]


def _fraction_text(value: Fraction) -> str:
    return f"{value.numerator}/{value.denominator}"


def _reject_constant(name: str) -> None:
    raise ContractError(must_be("EpisodeStats JSON", "free of NaN/Infinity", name))


def _load_document(text: str | bytes) -> dict[str, Any]:
    if not isinstance(text, (str, bytes, bytearray)):
        raise ContractError(must_be("text", "a JSON str or bytes", type(text).__name__))
    try:
        document = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ContractError):
            raise
        raise ContractError(must_be("EpisodeStats JSON", "valid JSON", str(exc))) from exc
    expected = {"version", "source", "lengths", "rewards"}
    if not isinstance(document, dict) or set(document) != expected:
        got = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise ContractError(must_be("EpisodeStats JSON", f"an object with keys {sorted(expected)}", got))
    if type(document["version"]) is not int or document["version"] != _JSON_VERSION:
        raise ContractError(must_be("version", str(_JSON_VERSION), document["version"]))
    if document["source"] is not None and document["source"] not in SOURCES:
        raise ContractError(must_be("source", f"null or one of {list(SOURCES)}", document["source"]))
    rewards = document["rewards"]
    if not isinstance(rewards, dict) or set(rewards) != set(SOURCES):
        raise ContractError(must_be("rewards", f"an object with keys {list(SOURCES)}", rewards))
    return document


def _count(name: str, value: Any, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ContractError(must_be(name, f"an integer >= {minimum}", value))
    return value


def _scope(name: str, value: Any, seen: list[Scope]) -> Scope:
    if value is not None and not isinstance(value, str):
        raise ContractError(must_be(name, "null or an adapter name", value))
    if value in seen:
        raise ContractError(must_be(name, "listed once", value))
    seen.append(value)
    return value


def _entries(name: str, value: Any, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or not all(isinstance(e, list) and len(e) == width for e in value):
        raise ContractError(must_be(name, f"a list of {width}-element lists", value))
    return value


def _parse_lengths(value: Any) -> dict[Scope, LengthHistogram]:
    lengths: dict[Scope, LengthHistogram] = {}
    seen: list[Scope] = []
    for scope, pairs, total in _entries("lengths", value, 3):
        scope = _scope("lengths scope", scope, seen)
        counts: dict[int, int] = {}
        for pair in _entries(f"lengths[{scope!r}] histogram", pairs, 2):
            length = _count("episode length", pair[0], minimum=0)
            if length in counts:
                raise ContractError(must_be("episode length", "listed once", length))
            counts[length] = _count("episode count", pair[1], minimum=1)
        if not counts:
            raise ContractError(must_be(f"lengths[{scope!r}] histogram", "non-empty", pairs))
        lengths[scope] = LengthHistogram(counts, _count("total length", total, minimum=0))
    return lengths


def _parse_rewards(document: dict[str, Any], source: str) -> dict[Scope, RewardMean]:
    means: dict[Scope, RewardMean] = {}
    seen: list[Scope] = []
    for scope, total, rollouts in _entries(f"rewards.{source}", document[source], 3):
        scope = _scope(f"rewards.{source} scope", scope, seen)
        if not isinstance(total, str) or not _FRACTION.fullmatch(total):
            raise ContractError(must_be("reward sum", "a 'numerator/denominator' string", total))
        numerator, denominator = (int(part) for part in total.split("/"))
        if denominator == 0 or math.gcd(numerator, denominator) != 1:
            raise ContractError(must_be("reward sum", "a reduced fraction with a non-zero denominator", total))
        means[scope] = RewardMean(Fraction(numerator, denominator), _count("rollouts", rollouts, minimum=1))
    return means


def _check_consistent(stats: EpisodeStats) -> None:
    """Reject documents no sequence of add_episode/merge could have produced."""
    episodes = stats.episodes
    if (stats._source is None) != (episodes == 0):
        raise ContractError(must_be("source", "null exactly when there are no episodes", stats._source))
    for source, means in stats._rewards.items():
        if set(means) - {None} - set(stats._lengths):
            raise ContractError(
                must_be(f"rewards.{source}", "scoped to adapters that have episodes", sorted(map(repr, means)))
            )
        if means and None not in means:
            raise ContractError(
                must_be(f"rewards.{source}", "to include the all-rollouts entry", sorted(map(repr, means)))
            )
        overall = means.get(None, RewardMean()).rollouts
        if overall > episodes or any(m.rollouts > overall for m in means.values()):
            raise ContractError(must_be(f"rewards.{source} rollouts", f"<= episodes={episodes}", overall))
