"""Did the policy learn? The reward curve of a run's ``trained.jsonl`` rows and its verdict.

Proven here, from hand-written rows: per seq the curve's reward is the sample-weighted mean of its
ranks' ``reward_mean`` (not the plain mean), its loss the ranks' mean, ``mismatch_max`` and
``staleness_max`` the worst rank's, ``elapsed_s`` the later rank's, ``samples`` the sum; rows in any
order give points in ascending seq. The verdict: fewer than ``2 * window`` batches is no verdict
(``learned`` False, a ``problem`` naming the counts); a rising curve is LEARNED, with
``reached_at_seq`` the first seq whose trailing-window mean reaches the threshold and
``reached_after_s`` that point's ``elapsed_s``; a flat curve is NOT LEARNED and never reaches it; the
first and last window means are the plain means of those batches' rewards; ``describe()`` says so.
"""

from __future__ import annotations

import random

import pytest

from rollout_bus.observe.learning import CurvePoint, LearningCurve, learning_curve


def _row(seq: int, rank: int, reward: float, samples: int, **more) -> dict:
    row = {"seq": seq, "rank": rank, "samples": samples, "reward_mean": reward, "loss": 0.1 * seq + rank,
           "mismatch_max": 1e-7 * (rank + 1), "full_vocab_mismatch_mean": 0.05 + 0.01 * rank,
           "staleness_max": rank, "elapsed_s": 2.0 * seq + 0.1 * rank}
    row.update(more)
    return row


def _curve(rewards: list[float], *, step_s: float = 1.5) -> LearningCurve:
    """A curve of one rank per seq: seq i earns ``rewards[i]``, finished ``step_s * (i + 1)`` seconds in."""
    return learning_curve([_row(i, 0, r, 8, elapsed_s=step_s * (i + 1)) for i, r in enumerate(rewards)])


def test_two_ranks_per_seq_give_the_sample_weighted_reward_and_the_worst_mismatch_and_staleness():
    rows = [
        _row(3, 0, 0.25, 12, mismatch_max=2e-6, staleness_max=1, elapsed_s=7.0, loss=0.4),
        _row(3, 1, 1.0, 4, mismatch_max=9e-6, staleness_max=0, elapsed_s=7.25, loss=0.2),
        _row(1, 1, 0.5, 6, mismatch_max=3e-6, staleness_max=2, elapsed_s=3.5, loss=-0.1),
        _row(1, 0, 0.0, 2, mismatch_max=1e-6, staleness_max=1, elapsed_s=3.0, loss=0.3),
        _row(2, 0, 0.75, 10, elapsed_s=5.0, loss=0.0),
    ]
    curve = learning_curve(rows)
    assert [p.seq for p in curve.points] == [1, 2, 3]  # unsorted input, ascending seqs
    one, two, three = curve.points
    assert three.reward == pytest.approx((0.25 * 12 + 1.0 * 4) / 16)  # 0.4375, not the plain mean 0.625
    assert one.reward == pytest.approx((0.0 * 2 + 0.5 * 6) / 8)  # 0.375, not 0.25
    assert two.reward == pytest.approx(0.75)  # one rank: its own
    assert (one.samples, two.samples, three.samples) == (8, 10, 16)
    assert three.mismatch_max == 9e-6 and one.mismatch_max == 3e-6  # the worst rank, whichever it is
    assert three.staleness_max == 1 and one.staleness_max == 2
    assert three.loss == pytest.approx(0.3) and one.loss == pytest.approx(0.1)
    assert three.full_vocab_mismatch_mean == pytest.approx(0.055)
    assert three.elapsed_s == 7.25 and one.elapsed_s == 3.5
    shuffled = rows[:]
    random.Random(5).shuffle(shuffled)
    assert learning_curve(shuffled).points == curve.points
    assert curve.to_json()[0] == {"seq": 1, "reward": one.reward, "loss": one.loss, "mismatch_max": 3e-6,
                                  "full_vocab_mismatch_mean": one.full_vocab_mismatch_mean, "staleness_max": 2.0,
                                  "elapsed_s": 3.5, "samples": 8}


def test_a_seq_without_samples_has_reward_zero_and_no_rows_give_no_points():
    assert learning_curve([_row(0, 0, 0.9, 0), _row(0, 1, 0.7, 0)]).points[0].reward == 0.0
    assert learning_curve([]).points == []


@pytest.mark.parametrize("batches", [0, 1, 9])
def test_fewer_than_two_windows_of_batches_cannot_show_learning(batches):
    verdict = _curve([1.0] * batches).verdict(window=5)
    assert verdict.learned is False and verdict.reached_at_seq is None and verdict.reached_after_s is None
    assert verdict.problem == f"{batches} batches trained, at least 10 needed"
    assert verdict.first_reward is None and verdict.last_reward is None
    assert verdict.describe() == f"learning: not shown ({verdict.problem})"


def test_a_rising_curve_is_learned_and_reaches_the_threshold_at_the_first_trailing_window_that_does():
    rewards = [0.0, 0.1, 0.0, 0.2, 0.3, 0.5, 0.9, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0]
    curve = _curve(rewards)
    verdict = curve.verdict(window=3, margin=0.3, threshold=0.9)
    assert verdict.problem is None and verdict.learned is True
    assert verdict.first_reward == pytest.approx(0.1 / 3)
    assert verdict.last_reward == pytest.approx(1.0)
    # trailing 3-batch means: ..., seq 7: (0.5+0.9+1.0)/3 = 0.8, seq 8: (0.9+1.0+1.0)/3 = 0.967 >= 0.9
    assert verdict.reached_at_seq == 8
    assert verdict.reached_after_s == curve.points[8].elapsed_s == pytest.approx(1.5 * 9)
    text = verdict.describe()
    assert "LEARNED" in text and "NOT LEARNED" not in text
    assert "reached 0.9 at batch 8 (13.5s after the first step)" in text
    # a higher threshold is reached later, or never
    assert curve.verdict(window=3, threshold=1.0).reached_at_seq == 12
    assert curve.verdict(window=3, threshold=1.01).reached_at_seq is None


def test_a_curve_at_the_threshold_from_the_start_reaches_it_at_the_first_full_window():
    verdict = _curve([0.85] * 12).verdict(window=4, threshold=0.8)
    assert verdict.reached_at_seq == 3 and verdict.reached_after_s == pytest.approx(6.0)
    assert verdict.learned is False  # high all along: no rise, nothing learned
    assert "NOT LEARNED (needs a rise of 0.3)" in verdict.describe()


def test_a_flat_curve_is_not_learned_and_never_reaches_the_threshold():
    verdict = _curve([0.05, 0.1, 0.0, 0.05] * 4).verdict(window=5)
    assert verdict.problem is None and verdict.learned is False
    assert verdict.reached_at_seq is None and verdict.reached_after_s is None
    assert verdict.first_reward == pytest.approx(0.05) and verdict.last_reward == pytest.approx(0.05)
    text = verdict.describe()
    assert "NOT LEARNED" in text and "never reached 0.8" in text


def test_a_rise_just_short_of_the_margin_is_not_learned_and_one_at_it_is():
    short = _curve([0.0] * 5 + [0.25] * 5).verdict(window=5, margin=0.3)
    assert short.learned is False and short.last_reward - short.first_reward == pytest.approx(0.25)
    enough = _curve([0.0] * 5 + [0.5] * 5).verdict(window=5, margin=0.3)
    assert enough.learned is True


def test_the_verdict_reads_points_as_given():
    points = [CurvePoint(seq=10 + i, reward=r, loss=0.0, mismatch_max=0.0, full_vocab_mismatch_mean=0.0,
                         staleness_max=0.0, elapsed_s=float(i), samples=4) for i, r in enumerate([0, 0, 1, 1])]
    verdict = LearningCurve(points).verdict(window=2, margin=0.5, threshold=1.0)
    assert verdict.learned is True and verdict.reached_at_seq == 13 and verdict.reached_after_s == 3.0


@pytest.mark.parametrize("window", [0, -1, True, 2.0])
def test_a_window_that_is_not_a_positive_int_is_refused_by_name(window):
    from rollout_bus.errors import ConfigError

    with pytest.raises(ConfigError, match="window"):
        _curve([0.1] * 12).verdict(window=window)


def test_the_run_report_shows_the_reward_against_batch_and_time_only_with_a_trainer():
    from rollout_bus.observe.report import RawRun, build_report
    from rollout_bus.observe.report_html import render_html
    from rollout_bus.wire.topics import Topics

    curve = _curve([0.0] * 5 + [0.2, 0.4, 0.6, 0.8, 0.9])
    page = render_html(build_report(RawRun(), Topics(prefix="r."), learning=curve))
    section = page[page.index("<h2>Learning</h2>"):]
    assert section.count("<svg") == 2
    assert "Reward per trained batch" in section and "seconds since the first step" in section
    assert "LEARNED" in section and section.count("<tr>") == 1 + len(curve.points)  # head + one row per batch
    assert "<h2>Learning</h2>" not in render_html(build_report(RawRun(), Topics(prefix="r.")))
