"""Sampler: the support it captures is the set transformers' warpers leave finite, and its log-probs are
the ones a trainer recomputes from that support.

Proven here: ``Sampler.warp``'s finite entries equal an independent numpy reference of temperature ->
top-k -> top-p (over a seeded sweep of logit rows and settings, including disabled top-k and top-p);
``draw`` samples inside its support, reports supports as ascending int32, log-probs equal to
``log_softmax`` over the support of ``logits / temperature`` and full-vocabulary log-probs equal to
``log_softmax`` of ``logits / temperature``; the same generator seed gives the same draw; unusable
settings are ``ConfigError``s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ConfigError
from rollout_bus.policy.sampler import Sampler

V = 17
ROWS = 200
SETTINGS = [  # (temperature, top_p, top_k)
    (1.0, 1.0, -1),  # no warper at all: every token is in the support
    (0.7, 1.0, -1),  # temperature only
    (1.0, 1.0, 3),  # top-k only
    (1.0, 0.9, -1),  # top-p only
    (0.5, 0.95, 10),
    (1.3, 0.5, 5),
    (2.0, 0.3, -1),
    (0.8, 0.99, 1),  # greedy through top-k
    (1.0, 0.7, V),  # top-k equal to the vocabulary: no effect
]


def _logit_rows(seed: int) -> np.ndarray:
    """ROWS float32 rows of V logits at mixed scales, so supports range from one token to all of them."""
    rng = np.random.default_rng(seed)
    scales = rng.choice([0.3, 1.0, 3.0, 8.0], size=(ROWS, 1))
    return (rng.standard_normal((ROWS, V)) * scales).astype(np.float32)


def _reference_support(row: np.ndarray, temperature: float, top_p: float, top_k: int) -> set[int] | None:
    """The support by hand, or None where the row sits on a boundary that float rounding may decide."""
    z = row.astype(np.float64) / temperature
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        ordered = np.sort(z)[::-1]
        if ordered[top_k - 1] - ordered[top_k] < 1e-6:
            return None  # a tie at the k-th place: which of the tied tokens survives is not ours to fix
        keep = z >= ordered[top_k - 1]
    if top_p < 1.0:
        ids = np.flatnonzero(keep)
        p = np.exp(z[ids] - z[ids].max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        descending = np.cumsum(p[order])
        ascending = np.cumsum(p[order][::-1])
        # transformers sorts ascending and drops tokens whose cumulative mass is <= 1 - top_p; we take the
        # smallest descending prefix whose mass reaches top_p. The two agree except where a cumulative sum
        # lands on the threshold, where float32 rounding in the warper decides: such rows are skipped.
        if np.any(np.abs(descending - top_p) < 1e-5) or np.any(np.abs(ascending - (1.0 - top_p)) < 1e-5):
            return None
        before = descending - p[order]  # mass of the tokens ranked above each token
        kept = before < top_p
        kept[0] = True  # at least one token
        cut = int(kept.sum())
        if cut < len(ids) and p[order][cut - 1] - p[order][cut] < 1e-9:
            return None  # equal probabilities across the cut: which one the sort puts first is arbitrary
        keep = np.zeros(V, dtype=bool)
        keep[ids[order[kept]]] = True
    return set(np.flatnonzero(keep).tolist())


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


@pytest.mark.parametrize("temperature, top_p, top_k", SETTINGS)
def test_the_warped_support_equals_a_numpy_reference_of_temperature_top_k_and_top_p(temperature, top_p, top_k):
    rows = _logit_rows(seed=int(temperature * 100) + int(top_p * 1000) + top_k)
    warped = Sampler(temperature, top_p, top_k).warp(torch.from_numpy(rows))
    assert warped.dtype == torch.float32 and warped.shape == (ROWS, V)
    checked = 0
    for row, scores in zip(rows, warped.numpy()):
        expected = _reference_support(row, temperature, top_p, top_k)
        if expected is None:
            continue
        checked += 1
        assert set(np.flatnonzero(np.isfinite(scores)).tolist()) == expected
        finite = np.isfinite(scores)
        # inside the support the scores are the tempered logits, untouched
        np.testing.assert_allclose(scores[finite], row[finite] / np.float32(temperature), rtol=1e-6, atol=1e-6)
    assert checked >= ROWS * 0.8, f"only {checked} of {ROWS} rows were away from a boundary"


@settings(max_examples=25, deadline=None)
@given(temperature=st.floats(0.2, 3.0), top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
       top_k=st.one_of(st.just(-1), st.just(0), st.integers(1, V + 3)), seed=st.integers(0, 2**16))
def test_any_setting_warps_to_the_reference_support(temperature, top_p, top_k, seed):
    rows = _logit_rows(seed)[:50]
    warped = Sampler(temperature, top_p, top_k).warp(torch.from_numpy(rows)).numpy()
    for row, scores in zip(rows, warped):
        expected = _reference_support(row, temperature, top_p, top_k)  # top_k <= 0 or >= V: no top-k
        if expected is not None:
            assert set(np.flatnonzero(np.isfinite(scores)).tolist()) == expected


def test_the_sweep_covers_supports_of_every_size():
    sizes = set()
    for temperature, top_p, top_k in SETTINGS:
        warped = Sampler(temperature, top_p, top_k).warp(torch.from_numpy(_logit_rows(seed=7)))
        sizes |= set(torch.isfinite(warped).sum(-1).tolist())
    assert {1, V} <= sizes and len(sizes) >= 10


@pytest.mark.parametrize("temperature, top_p, top_k", SETTINGS)
def test_a_draw_samples_inside_its_support_with_log_probs_over_that_support(temperature, top_p, top_k):
    rows = _logit_rows(seed=11)
    sampler = Sampler(temperature, top_p, top_k)
    draw = sampler.draw(torch.from_numpy(rows), torch.Generator().manual_seed(3))
    warped = sampler.warp(torch.from_numpy(rows)).numpy()
    assert draw.tokens.dtype == np.int64 and draw.tokens.shape == (ROWS,)
    assert draw.log_probs.dtype == np.float64 and draw.full_log_probs.dtype == np.float64
    assert len(draw.supports) == ROWS
    for i, (row, token, support) in enumerate(zip(rows, draw.tokens, draw.supports)):
        assert support.dtype == np.int32
        assert np.all(np.diff(support) > 0), "support ids must be strictly ascending"
        assert support.tolist() == np.flatnonzero(np.isfinite(warped[i])).tolist()
        assert int(token) in set(support.tolist())
        z = row.astype(np.float64) / temperature
        over_support = _log_softmax(z[support])[support.tolist().index(int(token))]
        assert draw.log_probs[i] == pytest.approx(over_support, abs=1e-5)
        assert draw.full_log_probs[i] == pytest.approx(_log_softmax(z)[token], abs=1e-5)
        # a subset's normaliser is at most the whole vocabulary's; 1e-6 allows float32 rounding when equal
        assert draw.log_probs[i] >= draw.full_log_probs[i] - 1e-6
        left_out = 1.0 - np.exp(_log_softmax(z)[support]).sum()  # the mass outside the support
        if len(support) == V:
            assert draw.log_probs[i] == pytest.approx(draw.full_log_probs[i], abs=1e-6)
        elif left_out > 1e-3:
            assert draw.log_probs[i] > draw.full_log_probs[i] + 5e-4


def test_top_k_of_one_always_draws_the_largest_logit():
    rows = _logit_rows(seed=5)
    draw = Sampler(1.0, 1.0, 1).draw(torch.from_numpy(rows), torch.Generator().manual_seed(0))
    assert draw.tokens.tolist() == rows.argmax(-1).tolist()
    assert all(s.tolist() == [t] for s, t in zip(draw.supports, draw.tokens))
    np.testing.assert_allclose(draw.log_probs, 0.0, atol=1e-6)


def test_the_same_generator_seed_gives_the_same_draw_and_another_seed_another():
    rows = torch.from_numpy(_logit_rows(seed=9))
    sampler = Sampler(0.9, 0.95, -1)
    first = sampler.draw(rows, torch.Generator().manual_seed(42))
    again = sampler.draw(rows, torch.Generator().manual_seed(42))
    other = sampler.draw(rows, torch.Generator().manual_seed(43))
    assert first.tokens.tolist() == again.tokens.tolist()
    np.testing.assert_array_equal(first.log_probs, again.log_probs)
    np.testing.assert_array_equal(first.full_log_probs, again.full_log_probs)
    assert first.tokens.tolist() != other.tokens.tolist()


def test_draws_follow_the_support_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    sampler = Sampler(1.0, 1.0, 3)
    generator = torch.Generator().manual_seed(1)
    counts = np.zeros(V)
    for _ in range(3000):
        counts[int(sampler.draw(logits, generator).tokens[0])] += 1
    expected = np.exp([2.0, 1.0, 0.0])
    expected /= expected.sum()
    assert counts[3:].sum() == 0
    np.testing.assert_allclose(counts[:3] / counts.sum(), expected, atol=0.03)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.1},
    {"temperature": float("nan")},
])
def test_unusable_sampler_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        Sampler(**kwargs)


def test_logits_that_are_not_a_non_empty_matrix_are_config_errors():
    with pytest.raises(ConfigError, match="logits"):
        Sampler().warp(torch.zeros(V))
    with pytest.raises(ConfigError, match="logits"):
        Sampler().warp(torch.zeros(0, V))


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", [(1.0, 1.0, -1, 0.1), (0.7, 0.95, 10, 0.05),
                                                              (1.3, 1.0, 5, 0.5), (1.0, 0.9, -1, 0.9)])
def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one(temperature, top_p, top_k, min_p):
    """min-p after top-k and top-p, as SGLang applies it: of the support without it, the tokens whose
    probability is at least ``min_p`` times the most likely token's (the ratio needs no renormalisation)."""
    without, with_min_p = Sampler(temperature, top_p, top_k), Sampler(temperature, top_p, top_k, min_p)
    rows = _logit_rows(11)
    checked = 0
    for row in rows:
        z = row.astype(np.float64) / temperature
        ratio = np.exp(z - z.max())
        if np.any(np.abs(ratio - min_p) < 1e-5):
            continue  # on the threshold: float32 rounding in the warper decides
        before = set(np.flatnonzero(np.isfinite(without.warp(torch.tensor(row[None])).numpy()[0])).tolist())
        after = set(np.flatnonzero(np.isfinite(with_min_p.warp(torch.tensor(row[None])).numpy()[0])).tolist())
        assert after == {i for i in before if ratio[i] >= min_p}
        checked += 1
    assert checked > ROWS * 0.9
    with pytest.raises(ConfigError, match="min_p"):
        Sampler(1.0, 1.0, -1, 1.0)
