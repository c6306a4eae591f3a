"""Did the policy learn? The reward curve of a training run, from its ``trained.jsonl``, and its verdict.

A loop that carries data faithfully but trains nothing looks healthy on every other dashboard; the
proof is the reward the generators' episodes earn, batch after batch, as the trainer's weights reach
them. This reads what ``rollout-bus train`` wrote (one row per rank per step) and answers with
numbers a person can check against the log.

Contract:

* ``learning_curve(rows)`` -> ``LearningCurve``: per trained seq (ascending) the sample-weighted mean
  raw reward over its ranks, the mean loss, the worst ``mismatch_max``, the mean
  ``full_vocab_mismatch_mean``, the worst ``staleness_max`` and the step's ``elapsed_s``.
* ``LearningCurve.verdict(window=5, margin=0.3, threshold=0.8)`` -> ``LearningVerdict``: the mean reward
  of the first and last ``window`` batches, ``learned`` when last - first >= ``margin``, and the first
  batch (seq, seconds) whose trailing ``window``-batch mean reaches ``threshold`` (None if never).
  Fewer than ``2 * window`` batches cannot show learning: ``learned`` is False and ``problem`` says why.
* ``to_json()`` of both is what ``rollout-bus demo --learn`` writes to ``learn.json``.
* ``reward_charts(curve)`` -> ``(by_batch, by_time)``: two inline-SVG line charts (``observe.charts``) of
  the reward, against the trained batch and against seconds since the first step (the run report and
  ``demo --learn`` show them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_bus.errors import ConfigError, must_be
from rollout_bus.observe.charts import Series, color_for, line_chart


@dataclass(frozen=True)
class CurvePoint:
    seq: int
    reward: float
    loss: float
    mismatch_max: float
    full_vocab_mismatch_mean: float
    staleness_max: float
    elapsed_s: float
    samples: int


@dataclass
class LearningVerdict:
    window: int
    margin: float
    threshold: float
    first_reward: float | None = None
    last_reward: float | None = None
    learned: bool = False
    reached_at_seq: int | None = None
    reached_after_s: float | None = None
    problem: str | None = None

    def describe(self) -> str:
        if self.problem is not None:
            return f"learning: not shown ({self.problem})"
        reached = (f"trailing {self.window}-batch reward reached {self.threshold} at batch {self.reached_at_seq} "
                   f"({self.reached_after_s:.1f}s after the first step)" if self.reached_at_seq is not None
                   else f"trailing {self.window}-batch reward never reached {self.threshold}")
        verdict = "LEARNED" if self.learned else f"NOT LEARNED (needs a rise of {self.margin})"
        return (f"learning: mean reward of the first {self.window} batches {self.first_reward:.3f}, of the last "
                f"{self.window} {self.last_reward:.3f}: {verdict}; {reached}")


@dataclass
class LearningCurve:
    points: list[CurvePoint] = field(default_factory=list)

    def verdict(self, window: int = 5, margin: float = 0.3, threshold: float = 0.8) -> LearningVerdict:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(must_be("window", "an int >= 1", window))
        out = LearningVerdict(window, margin, threshold)
        rewards = [p.reward for p in self.points]
        if len(rewards) < 2 * window:
            out.problem = f"{len(rewards)} batches trained, at least {2 * window} needed"
            return out
        out.first_reward = sum(rewards[:window]) / window
        out.last_reward = sum(rewards[-window:]) / window
        out.learned = out.last_reward - out.first_reward >= margin
        for i in range(window - 1, len(rewards)):
            if sum(rewards[i - window + 1:i + 1]) / window >= threshold:
                out.reached_at_seq, out.reached_after_s = self.points[i].seq, self.points[i].elapsed_s
                break
        return out

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.points]


def learning_curve(rows: Iterable[Mapping[str, Any]]) -> LearningCurve:
    """The curve of ``trained.jsonl``'s rows (see the module docstring)."""
    by_seq: dict[int, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_seq.setdefault(int(row["seq"]), []).append(row)
    curve = LearningCurve()
    for seq in sorted(by_seq):
        ranks = by_seq[seq]
        samples = sum(int(r["samples"]) for r in ranks)
        reward = (sum(float(r["reward_mean"]) * int(r["samples"]) for r in ranks) / samples) if samples else 0.0
        curve.points.append(CurvePoint(
            seq=seq, reward=reward, loss=sum(float(r["loss"]) for r in ranks) / len(ranks),
            mismatch_max=max(float(r["mismatch_max"]) for r in ranks),
            full_vocab_mismatch_mean=sum(float(r["full_vocab_mismatch_mean"]) for r in ranks) / len(ranks),
            staleness_max=max(float(r["staleness_max"]) for r in ranks),
            elapsed_s=max(float(r.get("elapsed_s", 0.0)) for r in ranks), samples=samples))
    return curve


def reward_charts(curve: LearningCurve) -> tuple[str, str]:
    """Reward against the trained batch, and against wall time since the first step (inline SVG)."""
    points = curve.points
    tips = [f"batch {p.seq}: reward {p.reward:.3f}, {p.elapsed_s:.1f}s, staleness {p.staleness_max:.0f}" for p in points]
    by_batch = line_chart([Series("reward", color_for(0), [p.seq for p in points], [p.reward for p in points],
                                  tips=tips)],
                          title="Reward per trained batch", x_label="batch (trainer step)", y_label="mean reward",
                          x_ticks=[(p.seq, str(p.seq)) for p in points[::max(1, len(points) // 10)]],
                          y_min=0.0, y_max=1.0)
    by_time = line_chart([Series("reward", color_for(1), [p.elapsed_s for p in points], [p.reward for p in points],
                                 tips=tips)],
                         title="Reward against wall time", x_label="seconds since the first step",
                         y_label="mean reward",
                         x_ticks=[(p.elapsed_s, f"{p.elapsed_s:.0f}") for p in points[::max(1, len(points) // 8)]],
                         y_min=0.0, y_max=1.0)
    return by_batch, by_time

