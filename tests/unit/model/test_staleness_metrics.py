"""Staleness metrics (``rollout_bus.model.metrics.compute_staleness_metrics``): hand-checked token-weighted cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.metrics import compute_staleness_metrics, sample_oldest_version
from rollout_bus.model.sample import AdapterRef, Sample

MATH = AdapterRef("math", 0)
CODE = AdapterRef("code", 1)


def make(response_length: int, *, token_versions=None, **fields) -> Sample:
    """A sample; ``token_versions`` set as an attribute, so this works with or without the Sample field."""
    sample = Sample(tokens=[1] * (response_length + 2), response_length=response_length, **fields)
    if token_versions is not None:
        sample.rollout_token_versions = np.asarray(token_versions, dtype=np.int64)
    return sample


def test_token_versions_weigh_each_trainable_token_and_skip_untrained_and_unversioned_ones():
    # trainable, versioned tokens: 3 and 4 (the masked 1 and the -1 are skipped) -> staleness 2, 1
    with_tokens = make(4, loss_mask=[1, 1, 0, 1], token_versions=[3, 4, 1, -1], weight_versions=["0"])
    # no token versions: its oldest weight version (2) for each of its 3 trainable tokens -> 3, 3, 3
    without = make(3, weight_versions=["4", "2", "x"])
    result = compute_staleness_metrics([with_tokens, without], step=5)
    assert result == {"staleness/mean": (2 + 1 + 3 + 3 + 3) / 5, "staleness/max": 3.0,
                      # the oldest version in the batch is the masked token's 1 (token versions win over
                      # weight_versions' 0 where a sample has them): 5 - 1
                      "staleness/oldest": 4.0}
    assert all(type(v) is float for v in result.values())


def test_the_fallback_is_the_oldest_numeric_weight_version_for_every_trainable_token():
    sample = make(4, loss_mask=[0, 1, 1, 0], weight_versions=["7", "draft", "5"])
    assert compute_staleness_metrics([sample], step=6) == {"staleness/mean": 1.0, "staleness/max": 1.0,
                                                           "staleness/oldest": 1.0}


def test_all_minus_one_token_versions_count_no_token_but_the_oldest_falls_back_to_weight_versions():
    forced = make(2, token_versions=[-1, -1], weight_versions=["3"])
    generated = make(2, token_versions=[4, 4])
    assert sample_oldest_version(forced) == 3 and sample_oldest_version(generated) == 4
    assert compute_staleness_metrics([forced, generated], step=4) == {
        "staleness/mean": 0.0, "staleness/max": 0.0, "staleness/oldest": 1.0}


def test_removed_samples_train_on_nothing_but_still_count_for_the_oldest_version():
    kept = make(2, weight_versions=["3"])
    removed = make(5, weight_versions=["1"], remove_sample=True)
    assert compute_staleness_metrics([kept, removed], step=3) == {
        "staleness/mean": 0.0, "staleness/max": 0.0, "staleness/oldest": 2.0}


def test_samples_without_a_numeric_version_contribute_nothing():
    assert compute_staleness_metrics([make(3), make(2, weight_versions=["policy-a"])], step=2) == {}
    versioned = make(1, weight_versions=["1"])
    assert compute_staleness_metrics([make(9), versioned], step=2) == compute_staleness_metrics([versioned], step=2)


def test_an_empty_batch_has_no_staleness():
    assert compute_staleness_metrics([], step=3) == {}


def test_a_version_ahead_of_the_step_gives_negative_staleness():
    assert compute_staleness_metrics([make(1, weight_versions=["4"])], step=2)["staleness/max"] == -2.0


def test_fully_masked_versioned_samples_have_an_oldest_but_no_mean():
    assert compute_staleness_metrics([make(2, loss_mask=[0, 0], weight_versions=["1"])], step=3) == {
        "staleness/oldest": 2.0}


def test_with_adapters_only_per_adapter_keys_each_over_its_own_samples():
    samples = [make(2, weight_versions=["1"], adapter=MATH),                          # 2, 2
               make(3, token_versions=[3, 2, 3], adapter=MATH),                       # 0, 1, 0
               make(1, weight_versions=["0"], adapter=CODE),                          # 3
               make(4, weight_versions=["0"]),                                        # adapter-less: none
               make(2, weight_versions=["2"], adapter=AdapterRef("math", 7))]         # math, another slot: 1, 1
    assert compute_staleness_metrics(samples, step=3) == {
        "adapter/code/staleness/mean": 3.0, "adapter/code/staleness/max": 3.0, "adapter/code/staleness/oldest": 3.0,
        "adapter/math/staleness/mean": (2 + 2 + 0 + 1 + 0 + 1 + 1) / 7, "adapter/math/staleness/max": 2.0,
        "adapter/math/staleness/oldest": 2.0}


def test_an_adapter_without_versions_has_no_keys():
    samples = [make(1, weight_versions=["1"], adapter=MATH), make(1, adapter=CODE)]
    assert set(compute_staleness_metrics(samples, step=1)) == {
        "adapter/math/staleness/mean", "adapter/math/staleness/max", "adapter/math/staleness/oldest"}


def test_malformed_token_versions_and_steps_raise_contract_error():
    with pytest.raises(ContractError, match="len\\(rollout_token_versions\\)"):
        compute_staleness_metrics([make(3, token_versions=[1, 2])], step=2)
    with pytest.raises(ContractError, match="step"):
        compute_staleness_metrics([make(1, weight_versions=["1"])], step=True)
    with pytest.raises(ContractError, match="step"):
        compute_staleness_metrics([make(1, weight_versions=["1"])], step=1.5)


@st.composite
def _samples(draw):
    length = draw(st.integers(0, 6))
    mask = draw(st.none() | st.lists(st.integers(0, 1), min_size=length, max_size=length))
    tokens = draw(st.none() | st.lists(st.integers(-1, 9), min_size=length, max_size=length))
    weights = draw(st.lists(st.sampled_from(["0", "3", "7", "x"]), max_size=3))
    return make(length, loss_mask=mask, token_versions=tokens, weight_versions=weights,
                remove_sample=draw(st.booleans()))


@given(st.lists(_samples(), max_size=6), st.integers(0, 12))
@settings(max_examples=200, deadline=None)
def test_the_metrics_match_a_naive_per_token_model(samples, step):
    per_token, oldest = [], []
    for s in samples:
        tokens = getattr(s, "rollout_token_versions", None)
        numeric = [int(v) for v in s.weight_versions if v.isdigit()]
        generated = [int(v) for v in tokens if v >= 0] if tokens is not None else []
        if generated or numeric:
            oldest.append(min(generated) if generated else min(numeric))
        if s.remove_sample:
            continue
        for i in range(s.response_length):
            if s.loss_mask is not None and not s.loss_mask[i]:
                continue
            if tokens is not None:
                if tokens[i] >= 0:
                    per_token.append(step - int(tokens[i]))
            elif numeric:
                per_token.append(step - min(numeric))
    expected = {}
    if per_token:
        expected |= {"staleness/mean": sum(per_token) / len(per_token), "staleness/max": float(max(per_token))}
    if oldest:
        expected["staleness/oldest"] = float(step - min(oldest))
    assert compute_staleness_metrics(samples, step) == expected
