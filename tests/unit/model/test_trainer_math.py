"""Trainer math: support-restricted log-probs against the dense reference, ratios, the GRPO loss, shards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout_bus.errors import ContractError
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.model.shard_tensors import shard_tensors
from rollout_bus.model.train_data import convert_samples_to_train_data, split_train_data_by_dp
from rollout_bus.model.shards import batch_path, load_shard, write_batch_shards
from rollout_bus.model.trainer_math import (
    dense_support_log_probs,
    grpo_tis_loss,
    importance_ratios,
    shard_support_log_probs,
    support_log_probs,
)


def make_case(rng: np.random.Generator, rows: int, vocab: int, dtype=torch.float32, scale: float = 3.0):
    """Random logits and supports (sizes 1..V, with singletons and full-vocabulary rows), targets in support."""
    kinds = rng.integers(0, 4, rows)
    sizes = np.where(kinds == 0, 1, np.where(kinds == 1, vocab, rng.integers(1, vocab + 1, rows)))
    supports = [rng.choice(vocab, int(s), replace=False) for s in sizes]
    ids = np.concatenate(supports) if rows else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    targets = np.array([s[rng.integers(0, len(s))] for s in supports], dtype=np.int64)
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)) * scale).to(dtype)
    return (logits, torch.from_numpy(targets), torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(offsets),
            sizes)


# ---------------------------------------------------------------------------- support_log_probs


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_restricted_log_probs_equal_the_dense_reference_on_random_cases(dtype, atol):
    rng = np.random.default_rng(0)
    for _ in range(40):
        rows, vocab = int(rng.integers(0, 40)), int(rng.integers(1, 301))
        logits, targets, ids, offsets, sizes = make_case(rng, rows, vocab, dtype)
        got = support_log_probs(logits, targets, ids, offsets)
        want = dense_support_log_probs(logits, targets, ids, offsets)
        assert got.shape == (rows,) and got.dtype == dtype
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert torch.all(got[torch.from_numpy(sizes == 1)] == 0.0)  # forced tokens: exactly zero
        full = torch.from_numpy(sizes == vocab)
        plain = logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(got[full], plain[full], atol=atol, rtol=0)
        assert torch.all(got <= 0)


@given(data=st.data(), rows=st.integers(0, 12), vocab=st.integers(1, 300))
def test_restricted_log_probs_equal_the_dense_reference_property(data, rows, vocab):
    seed = data.draw(st.integers(0, 2**32 - 1))
    logits, targets, ids, offsets, _ = make_case(np.random.default_rng(seed), rows, vocab, torch.float64)
    torch.testing.assert_close(support_log_probs(logits, targets, ids, offsets),
                               dense_support_log_probs(logits, targets, ids, offsets), atol=1e-12, rtol=0)


def test_singleton_supports_give_exactly_zero_even_for_extreme_logits():
    logits = torch.tensor([[1e30, -1e30, 0.0], [-3.0e4, 7.0, 2.0], [0.0, 0.0, 88.0]])
    targets = torch.tensor([1, 0, 2])
    out = support_log_probs(logits, targets, torch.tensor([1, 0, 2], dtype=torch.int32), torch.tensor([0, 1, 2, 3]))
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_large_logits_are_stable():
    rng = np.random.default_rng(1)
    logits, targets, ids, offsets, _ = make_case(rng, 30, 200, torch.float32, scale=1e4)
    got = support_log_probs(logits, targets, ids, offsets)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense_support_log_probs(logits, targets, ids, offsets), atol=1e-2, rtol=1e-6)


def test_the_restricted_path_never_touches_the_dense_vocabulary():
    # A [4, 10^9] view of 4 numbers (stride 0): any dense [R, V] work would need 16 GB and minutes.
    logits = torch.arange(4, dtype=torch.float32).unsqueeze(1).expand(4, 10**9)
    ids = torch.tensor([999_999_999, 7, 8, 123, 0, 5, 10**8, 42, 3], dtype=torch.int32)
    offsets = torch.tensor([0, 1, 3, 4, 9])
    out = support_log_probs(logits, torch.tensor([999_999_999, 8, 123, 42]), ids, offsets)
    torch.testing.assert_close(out, -torch.tensor([1.0, 2.0, 1.0, 5.0]).log())  # equal logits: -log |support|


def test_no_tokens_give_an_empty_tensor():
    logits = torch.zeros(0, 7, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64)
    out = support_log_probs(logits, empty, empty.to(torch.int32), torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0,) and out.dtype == torch.float32
    assert dense_support_log_probs(logits, empty, empty, torch.zeros(1, dtype=torch.int64)).shape == (0,)
    out.sum().backward()
    assert logits.grad.shape == (0, 7)


def test_low_precision_logits_are_reduced_in_float32():
    rng = np.random.default_rng(2)
    logits, targets, ids, offsets, _ = make_case(rng, 20, 64, torch.float32)
    half = logits.to(torch.bfloat16)
    got = support_log_probs(half, targets, ids, offsets)
    assert got.dtype == torch.float32
    want = dense_support_log_probs(half.float(), targets, ids, offsets)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_gradients_equal_the_dense_reference():
    rng = np.random.default_rng(3)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        logits, targets, ids, offsets, _ = make_case(rng, 25, 120, dtype)
        weights = torch.from_numpy(rng.normal(size=25)).to(dtype)
        grads = []
        for fn in (support_log_probs, dense_support_log_probs):
            leaf = logits.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad((fn(leaf, targets, ids, offsets) * weights).sum(), leaf)
            grads.append(grad)
        torch.testing.assert_close(grads[0], grads[1], atol=atol, rtol=0)
        outside = torch.ones_like(logits, dtype=torch.bool)
        outside[torch.repeat_interleave(torch.arange(25), offsets.diff()), ids.long()] = False
        assert torch.all(grads[0][outside] == 0)  # logits outside the support get no gradient


def test_gradcheck_on_a_tiny_float64_case():
    logits, targets, ids, offsets, _ = make_case(np.random.default_rng(4), 5, 9, torch.float64)
    leaf = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: support_log_probs(x, targets, ids, offsets), (leaf,))


def _base():
    """Three rows over V=6: supports {1,2}, {4}, {0,3,5}; targets in them."""
    return (torch.randn(3, 6), torch.tensor([2, 4, 5]), torch.tensor([1, 2, 4, 0, 3, 5], dtype=torch.int32),
            torch.tensor([0, 2, 3, 6]))


@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0], torch.tensor([2, 4, 1]), a[2], a[3]), r"'targets\[2\]' must be in the sampling support of row 2"),
    (lambda a: (a[0], torch.tensor([2, 3, 5]), a[2], a[3]), r"'targets\[1\]' must be in the sampling support of row 1"),
    (lambda a: (a[0], torch.tensor([2, 4, 9]), a[2], a[3]), r"'targets\[2\]' must be a token id in \[0, V = 6\)"),
    (lambda a: (a[0], a[1], a[2], torch.tensor([0, 2, 2, 6])), r"'support of row 1' must be non-empty"),
    (lambda a: (a[0], a[1], a[2], torch.tensor([0, 2, 6])), r"'support_offsets' must be R\+1 = 4 entries \(got 3\)"),
    (lambda a: (a[0], a[1], a[2], torch.tensor([1, 2, 3, 6])), r"'support_offsets' must be a CSR from 0"),
    (lambda a: (a[0], a[1], a[2], torch.tensor([0, 2, 3, 5])), r"'support_offsets' must be a CSR from 0 .* = 6"),
    (lambda a: (a[0], a[1], a[2], torch.tensor([0, 3, 2, 6])), r"'support_offsets' must be non-decreasing"),
    (lambda a: (a[0], a[1], a[2], a[3].float()), r"'support_offsets' must be a 1-D integer tensor"),
    (lambda a: (a[0], a[1][:2], a[2], a[3]), r"'targets' must be R = 3 entries"),
    (lambda a: (a[0], a[1].float(), a[2], a[3]), r"'targets' must be a 1-D integer tensor"),
    (lambda a: (a[0][0], a[1], a[2], a[3]), r"'logits' must be a 2-D floating tensor"),
    (lambda a: (a[0].long(), a[1], a[2], a[3]), r"'logits' must be a 2-D floating tensor"),
    (lambda a: (a[0], a[1], torch.tensor([1, 2, 4, 0, 3, 6]), a[3]),
     r"'support_ids' must be token ids in \[0, V = 6\)"),
    (lambda a: (a[0], a[1], torch.tensor([1, 2, 4, 0, -3, 5]), a[3]), r"'support_ids' .* \(got '-3 at index 4'\)"),
    (lambda a: (a[0], a[1], torch.tensor([1, 2, 4, 5, 3, 5]), a[3]), r"'support of row 2' must be a set of distinct"),
    (lambda a: (a[0], a[1], a[2].reshape(2, 3), a[3]), r"'support_ids' must be a 1-D integer tensor"),
])
@pytest.mark.parametrize("fn", [support_log_probs, dense_support_log_probs])
def test_bad_inputs_raise_value_errors_naming_the_field_or_row(fn, change, match):
    with pytest.raises(ContractError, match=match) as info:
        fn(*change(_base()))
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------- importance_ratios


def test_importance_ratios_truncate_and_detach_the_tis_weight():
    new = torch.log(torch.tensor([0.1, 1.0, 3.0, 0.5])).requires_grad_(True)
    rollout = torch.zeros(4)
    ratio, tis = importance_ratios(new, rollout)
    torch.testing.assert_close(ratio.detach(), torch.tensor([0.1, 1.0, 3.0, 0.5]))
    torch.testing.assert_close(tis, torch.tensor([0.1, 1.0, 2.0, 0.5]))
    assert ratio.requires_grad and not tis.requires_grad
    (grad,) = torch.autograd.grad(ratio.sum(), new)
    torch.testing.assert_close(grad, torch.tensor([0.1, 1.0, 3.0, 0.5]))
    _, tis = importance_ratios(new, rollout, clip_max=5.0, clip_min=0.2)
    torch.testing.assert_close(tis, torch.tensor([0.2, 1.0, 3.0, 0.5]))
    _, tis = importance_ratios(new, rollout, clip_max=None)
    torch.testing.assert_close(tis, torch.tensor([0.1, 1.0, 3.0, 0.5]))


@pytest.mark.parametrize("args, kwargs, match", [
    ((torch.zeros(3), torch.zeros(4)), {}, r"'rollout_log_probs' must be of the shape of new_log_probs \[3\]"),
    ((torch.zeros(3), torch.zeros(3, dtype=torch.int64)), {}, r"'rollout_log_probs' must be a floating tensor"),
    ((torch.zeros(3), torch.zeros(3)), {"clip_max": 0.0}, r"'clip_max' must be > 0"),
    ((torch.zeros(3), torch.zeros(3)), {"clip_max": 1.0, "clip_min": 2.0}, r"'clip_min' must be <= clip_max"),
])
def test_importance_ratios_reject_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        importance_ratios(*args, **kwargs)


# ---------------------------------------------------------------------------- grpo_tis_loss


def test_on_policy_loss_is_minus_the_mean_advantage_over_masked_tokens():
    new = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    advantages = torch.tensor([1.0, -2.0, 0.5, 100.0])
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.uint8)
    loss, stats = grpo_tis_loss(new, new.detach().clone(), advantages, mask)
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    assert stats == {"loss": pytest.approx(0.5 / 3), "mean_abs_log_ratio": 0.0, "clip_fraction": 0.0,
                     "tis_truncated_fraction": 0.0}
    (grad,) = torch.autograd.grad(loss, new)  # d/dnew of -ratio*A at ratio 1 is -A / count
    torch.testing.assert_close(grad, torch.tensor([-1.0, 2.0, -0.5, 0.0]) / 3)


def test_the_clip_binds_only_where_it_lowers_the_objective():
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 3.0])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    new = ratios.log().requires_grad_(True)
    loss, stats = grpo_tis_loss(new, torch.zeros(6), advantages, torch.ones(6, dtype=torch.bool), clip_eps=0.2)
    # per token: -min(rA, clip(r)A) = -1.2, 1.5, -0.5, 0.8, -1.1, -1.2
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8 - 1.1 - 1.2) / 6)
    assert stats["clip_fraction"] == pytest.approx(3 / 6)  # tokens 0, 3 and 5
    assert stats["tis_truncated_fraction"] == pytest.approx(1 / 6)  # ratio 3.0 > tis_clip 2.0 (diagnostic)
    assert stats["mean_abs_log_ratio"] == pytest.approx(float(ratios.log().abs().mean()), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, new)
    assert grad[[0, 3, 5]].tolist() == [0.0, 0.0, 0.0]  # clipped tokens carry no gradient
    assert grad[1].item() == pytest.approx(1.5 / 6) and grad[2].item() == pytest.approx(-0.5 / 6)


def test_old_log_probs_switch_on_the_truncated_importance_weight():
    rollout = torch.zeros(3)
    old = torch.log(torch.tensor([0.5, 1.0, 4.0]))  # behaviour ratios 0.5, 1, 4 -> weights 0.5, 1, 2
    new = old.clone().requires_grad_(True)  # on-policy w.r.t. old: ratio 1 everywhere
    advantages = torch.tensor([1.0, 2.0, 3.0])
    loss, stats = grpo_tis_loss(new, rollout, advantages, torch.ones(3), old_log_probs=old, tis_clip=2.0)
    assert loss.item() == pytest.approx(-(0.5 * 1 + 1 * 2 + 2 * 3) / 3)
    assert stats["tis_truncated_fraction"] == pytest.approx(1 / 3)
    assert stats["mean_abs_log_ratio"] == 0.0 and stats["clip_fraction"] == 0.0


def test_an_all_masked_batch_gives_a_zero_loss_that_still_backpropagates():
    new = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, stats = grpo_tis_loss(new, torch.tensor([5.0, -5.0]), torch.ones(2), torch.zeros(2, dtype=torch.uint8))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert new.grad.tolist() == [0.0, 0.0]
    assert stats == {"loss": 0.0, "mean_abs_log_ratio": 0.0, "clip_fraction": 0.0, "tis_truncated_fraction": 0.0}
    loss, _ = grpo_tis_loss(torch.zeros(0, requires_grad=True), torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert loss.item() == 0.0 and loss.requires_grad


def test_masked_tokens_do_not_count_even_when_not_finite():
    new = torch.tensor([-1.0, 0.0], requires_grad=True)
    loss, stats = grpo_tis_loss(new, torch.tensor([-1.0, -math.inf]), torch.tensor([2.0, 1.0]), torch.tensor([1, 0]))
    assert loss.item() == pytest.approx(-2.0) and stats["tis_truncated_fraction"] == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"loss_mask": torch.ones(2)}, r"'loss_mask' must be a tensor of the shape of new_log_probs \[3\]"),
    ({"loss_mask": torch.tensor([0.0, 0.5, 1.0])}, r"'loss_mask' must be 0 or 1 everywhere"),
    ({"advantages": torch.ones(4)}, r"'advantages' must be of the shape"),
    ({"clip_eps": 1.5}, r"'clip_eps' must be in \[0, 1\)"),
    ({"tis_clip": 0.0}, r"'tis_clip' must be > 0"),
    ({"old_log_probs": torch.zeros(2)}, r"'old_log_probs' must be of the shape"),
])
def test_grpo_tis_loss_rejects_bad_inputs(kwargs, match):
    args = {"new_log_probs": torch.zeros(3), "rollout_log_probs": torch.zeros(3), "advantages": torch.ones(3),
            "loss_mask": torch.ones(3)} | kwargs
    with pytest.raises(ValueError, match=match):
        grpo_tis_loss(**args)


# ---------------------------------------------------------------------------- shard_support_log_probs


def make_samples(rng: np.random.Generator, n: int, vocab: int, masks: bool = True) -> list[Sample]:
    """Samples whose response tokens lie in their supports; some responses are empty."""
    samples = []
    for i in range(n):
        response_length = int(rng.integers(0, 9)) if i % 4 else 0
        rows = [rng.choice(vocab, int(rng.choice([1, 1, 2, 5, vocab])), replace=False) for _ in range(response_length)]
        response = [int(r[rng.integers(0, len(r))]) for r in rows]
        tokens = np.concatenate([rng.integers(0, vocab, int(rng.integers(1, 5))), np.array(response, np.int64)])
        samples.append(Sample(
            group_index=i // 2, index=i, rollout_id=i, tokens=tokens, response_length=response_length,
            reward=float(i % 2), loss_mask=np.ones(response_length, np.int64),
            rollout_log_probs=rng.normal(size=response_length),
            rollout_sampling_mask=RolloutSamplingMask.from_mask_list(rows) if masks else None,
            status=Status.COMPLETED,
        ))
    return samples


def per_sample_dense(logits: torch.Tensor, samples: list[Sample], order: list[int]) -> torch.Tensor:
    """The expected result: each sample on its own, with the dense reference, concatenated in shard order."""
    parts, start = [], 0
    for p in order:
        sample = samples[p]
        length = sample.response_length
        ids, offsets = sample.rollout_sampling_mask.as_tensors()
        targets = torch.as_tensor(np.asarray(sample.tokens)[len(sample.tokens) - length:], dtype=torch.int64)
        parts.append(dense_support_log_probs(logits[start:start + length], targets, ids, offsets))
        start += length
    return torch.cat(parts)


def test_a_whole_shard_equals_the_per_sample_dense_computation():
    rng, vocab = np.random.default_rng(5), 40
    samples = make_samples(rng, 9, vocab)
    (rank,) = split_train_data_by_dp(convert_samples_to_train_data(samples), 1)
    tensors = {k: torch.from_numpy(v) for k, v in shard_tensors(rank).items()}
    total = int(tensors["response_lengths"].sum())
    logits = torch.from_numpy(rng.normal(size=(total, vocab)) * 2).requires_grad_(True)
    got = shard_support_log_probs(logits, tensors)
    assert got.shape == (total,)
    torch.testing.assert_close(got, per_sample_dense(logits, samples, rank["partition"]), atol=1e-12, rtol=0)
    got.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_shards_read_back_from_disk_work_unchanged(tmp_path):
    rng, vocab = np.random.default_rng(6), 25
    samples = make_samples(rng, 12, vocab)
    ranks = split_train_data_by_dp(convert_samples_to_train_data(samples), 2)
    manifest = write_batch_shards(tmp_path, 0, ranks, metrics={}, sources=[])
    for entry in manifest["shards"]:
        view = load_shard(batch_path(tmp_path, 0) / entry["path"])
        total = int(view.tensors["response_lengths"].sum())
        logits = torch.from_numpy(rng.normal(size=(total, vocab))).float()
        order = view.tensors["partition"].tolist()
        torch.testing.assert_close(shard_support_log_probs(logits, view.tensors),
                                   per_sample_dense(logits.double(), samples, order).float(), atol=1e-5, rtol=0)


def test_shard_problems_raise_value_errors():
    rng = np.random.default_rng(7)
    (rank,) = split_train_data_by_dp(convert_samples_to_train_data(make_samples(rng, 5, 10, masks=False)), 1)
    tensors = {k: torch.from_numpy(v) for k, v in shard_tensors(rank).items()}
    total = int(tensors["response_lengths"].sum())
    with pytest.raises(ValueError, match=r"'tensors' must be a shard with sampling masks"):
        shard_support_log_probs(torch.zeros(total, 10), tensors)
    samples = make_samples(rng, 5, 10)
    (rank,) = split_train_data_by_dp(convert_samples_to_train_data(samples), 1)
    tensors = {k: torch.from_numpy(v) for k, v in shard_tensors(rank).items()}
    total = int(tensors["response_lengths"].sum())
    with pytest.raises(ValueError, match=rf"'logits' must be \[R, V\] with R = {total} response tokens"):
        shard_support_log_probs(torch.zeros(total + 1, 10), tensors)
    short = tensors | {"rollout_sampling_mask_offsets": tensors["rollout_sampling_mask_offsets"][:-1]}
    with pytest.raises(ValueError, match=rf"'rollout_sampling_mask_offsets' must be R\+1 = {total + 1} entries"):
        shard_support_log_probs(torch.zeros(total, 10), short)
    with pytest.raises(ValueError, match=r"'tensors' must be a shard's tensors with \['tokens'\]"):
        shard_support_log_probs(torch.zeros(total, 10), {k: v for k, v in tensors.items() if k != "tokens"})
