"""Trainer-side math on shards: log-probs restricted to the sampling support, importance ratios, a loss.

The generator samples each response token from a top-p / top-k *support*, not from the whole
vocabulary, and its log-prob is over that support. A trainer that scores the same token with a
full-vocabulary ``log_softmax`` compares two different distributions, and the importance ratio
between them drifts even when the weights are equal. The shard carries every support as one CSR
(``rollout_sampling_mask_ids`` / ``rollout_sampling_mask_offsets``), so the trainer can
renormalise over exactly the ids the generator could have drawn (``rollout_bus.sim.sampling`` reports
``log(p_token / sum(p_support))`` of the temperature-scaled logits, so divide the trainer's logits
by the same temperature first). This module does it without ever building a dense ``[R, V]``
mask: it gathers the ``N`` support logits and reduces them per row, O(N) work and memory on top
of the logits, and autograd flows through it. Pure torch, no I/O.

Contract:

* ``support_log_probs(logits, targets, support_ids, support_offsets)`` returns, for every row
  ``t``, ``logits[t, targets[t]] - logsumexp(logits[t, support(t)])`` (shape ``[R]``), where
  ``support(t) = support_ids[support_offsets[t]:support_offsets[t + 1]]``. A singleton support
  (a forced token) gives exactly ``0.0``; the full vocabulary gives ``log_softmax``. It is
  vectorised (no Python loop over tokens), numerically stable (the per-row max is subtracted)
  and differentiable w.r.t. ``logits``. It computes in the logits' dtype, except that float16 and
  bfloat16 logits are reduced in float32 (the result is then float32). ``logits`` is ``[R, V]``
  floating; ``targets`` ``[R]`` integers; ``support_ids`` ``[N]`` integers in ``[0, V)``;
  ``support_offsets`` ``[R + 1]`` integers from 0 to ``N``, non-decreasing. Raises
  ``ContractError`` (a ``ValueError``) naming the field, or the first bad row, when a shape or
  dtype is wrong, a support is empty, an id repeats within a row (a support is a set), an id or
  target is outside the vocabulary, or a target is not in its row's support. ``R = 0`` returns an
  empty tensor. Validation reads values back, so on an accelerator it synchronises.
* ``dense_support_log_probs(...)`` (same arguments, same checks, same result) is the slow
  reference: a dense boolean ``[R, V]`` mask, ``-inf`` outside it, ``log_softmax``, gather. For
  tests and the bench only.
* ``importance_ratios(new_log_probs, rollout_log_probs, *, clip_max=2.0, clip_min=None)`` returns
  ``(ratio, tis_weight)``: ``ratio = exp(new - rollout)`` (carries gradient) and the truncated
  importance weight ``ratio.clamp(max=clip_max)`` (and ``min=clip_min`` when given; ``clip_max=None``:
  no upper bound), detached; the rollout log-probs are treated as constants.
* ``shard_support_log_probs(logits, tensors)`` applies ``support_log_probs`` to a whole shard:
  ``tensors`` holds the shard's tensors as ``ShardView.tensors`` does (``tokens``,
  ``tokens_offsets``, ``response_lengths``, ``rollout_sampling_mask_ids``,
  ``rollout_sampling_mask_offsets``); ``logits`` is ``[R, V]`` for the shard's ``R`` response
  tokens in shard order; the targets are each sample's last ``response_lengths[i]`` tokens.
  Raises ``ContractError`` when the shard has no sampling masks or the sizes disagree.
* ``response_token_index(tensors)``: where each response token of a shard sits in its flat ``tokens``
  (``[R]`` int64, shard order), the rows a trainer gathers its logits for.
* ``grpo_tis_loss(new_log_probs, rollout_log_probs, advantages, loss_mask, *, clip_eps=0.2,
  tis_clip=2.0, old_log_probs=None)`` returns ``(loss, stats)``: the PPO/GRPO clipped surrogate
  ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` averaged over tokens with ``loss_mask == 1``
  (none: a zero loss that still requires grad). With ``old_log_probs=None`` the rollout policy is
  the old policy, ``r = exp(new - rollout)``, and no TIS weight is applied (``r`` already is the
  whole correction; see the function). With ``old_log_probs`` (the trainer's recomputation at the
  generating weights), ``r = exp(new - old)`` and each token's term is multiplied by the detached
  ``min(exp(old - rollout), tis_clip)`` (decoupled PPO with truncated importance sampling).
  ``stats`` holds Python floats ``loss``, ``mean_abs_log_ratio``, ``clip_fraction`` and
  ``tis_truncated_fraction`` over the masked tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rollout_bus.errors import ContractError, must_be

_MASK_IDS, _MASK_OFFSETS = "rollout_sampling_mask_ids", "rollout_sampling_mask_offsets"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _problem(name: str, expected: str, value: Any) -> ContractError:
    return ContractError(must_be(name, expected, value))


def _is_int(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def _one_d_ints(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _problem(name, "a torch tensor", type(t).__name__)
    if t.ndim != 1 or not _is_int(t):
        raise _problem(name, "a 1-D integer tensor", f"{t.dtype} {list(t.shape)}")
    return t


def _check_support(logits: Any, targets: Any, support_ids: Any, support_offsets: Any,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the four inputs; return (targets, ids, row of each id, index in ids of each row's target),
    int64 on the logits' device."""
    if not isinstance(logits, torch.Tensor):
        raise _problem("logits", "a torch tensor", type(logits).__name__)
    if logits.ndim != 2 or not logits.dtype.is_floating_point:
        raise _problem("logits", "a 2-D floating tensor [R, V]", f"{logits.dtype} {list(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    targets = _one_d_ints("targets", targets)
    ids = _one_d_ints("support_ids", support_ids)
    offsets = _one_d_ints("support_offsets", support_offsets)
    if targets.numel() != rows:
        raise _problem("targets", f"R = {rows} entries (one per logits row)", targets.numel())
    if offsets.numel() != rows + 1:
        raise _problem("support_offsets", f"R+1 = {rows + 1} entries", offsets.numel())
    targets, ids, offsets = (t.to(device=device, dtype=torch.int64) for t in (targets, ids, offsets))
    n = ids.numel()
    if int(offsets[0]) != 0 or int(offsets[-1]) != n:
        raise _problem("support_offsets", f"a CSR from 0 to len(support_ids) = {n}",
                       f"{int(offsets[0])}..{int(offsets[-1])}")
    counts = offsets.diff()
    if rows:
        low = int(counts.min())
        if low < 0:
            raise _problem("support_offsets", "non-decreasing", f"a step of {low} at row {int(counts.argmin())}")
        if low == 0:
            row = int((counts == 0).nonzero()[0])
            raise _problem(f"support of row {row}", "non-empty", "offsets[t] == offsets[t+1]")
    if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = int(((ids < 0) | (ids >= vocab)).nonzero()[0])
        raise _problem("support_ids", f"token ids in [0, V = {vocab})", f"{int(ids[bad])} at index {bad}")
    if rows and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        bad = int(((targets < 0) | (targets >= vocab)).nonzero()[0])
        raise _problem(f"targets[{bad}]", f"a token id in [0, V = {vocab})", int(targets[bad]))
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), counts, output_size=n)
    if n > rows:  # some row has two or more ids: they must be distinct
        keys = (row_of * vocab + ids).sort().values
        repeated = keys[1:] == keys[:-1]
        if bool(repeated.any()):
            key = int(keys[1:][repeated][0])
            raise _problem(f"support of row {key // vocab}", "a set of distinct ids", f"id {key % vocab} repeated")
    is_target = ids == targets[row_of]
    hits = torch.zeros(rows, dtype=torch.int64, device=device).index_add_(0, row_of, is_target.to(torch.int64))
    if rows and not bool(hits.all()):
        row = int((hits == 0).nonzero()[0])
        raise _problem(f"targets[{row}]", f"in the sampling support of row {row}", int(targets[row]))
    return targets, ids, row_of, is_target.nonzero().squeeze(1)  # ids are distinct: one hit per row, in row order


def support_log_probs(logits: torch.Tensor, targets: torch.Tensor, support_ids: torch.Tensor,
                      support_offsets: torch.Tensor) -> torch.Tensor:
    """Each target's log-prob renormalised over its row's sampling support, ``[R]`` (see the module contract)."""
    _, ids, row_of, target_at = _check_support(logits, targets, support_ids, support_offsets)
    rows = logits.shape[0]
    work_dtype = torch.float32 if logits.dtype in _LOW_PRECISION else logits.dtype
    values = logits[row_of, ids].to(work_dtype)  # [N]: the only logits the result depends on
    # Segment max (a constant shift, so detached: the gradient of logsumexp does not depend on it).
    seg_max = torch.full((rows,), -torch.inf, dtype=work_dtype, device=logits.device)
    seg_max = seg_max.scatter_reduce(0, row_of, values.detach(), reduce="amax", include_self=True)
    shifted = (values - seg_max[row_of]).exp()
    sums = torch.zeros(rows, dtype=work_dtype, device=logits.device).index_add(0, row_of, shifted)
    log_norm = seg_max + sums.log()
    return values[target_at] - log_norm  # one gather from logits, so backward allocates one [R, V] gradient


def dense_support_log_probs(logits: torch.Tensor, targets: torch.Tensor, support_ids: torch.Tensor,
                            support_offsets: torch.Tensor) -> torch.Tensor:
    """The slow reference for ``support_log_probs``: a dense ``[R, V]`` mask, ``-inf`` outside, ``log_softmax``."""
    targets, ids, row_of, _ = _check_support(logits, targets, support_ids, support_offsets)
    work = logits.float() if logits.dtype in _LOW_PRECISION else logits
    inside = torch.zeros(work.shape, dtype=torch.bool, device=work.device)
    inside[row_of, ids] = True
    masked = work.masked_fill(~inside, -torch.inf)
    return masked.log_softmax(dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def _same_shape_floats(**tensors: Any) -> torch.Size:
    shape = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _problem(name, "a floating tensor", got)
        if shape is None:
            shape, first = t.shape, name
        elif t.shape != shape:
            raise _problem(name, f"of the shape of {first} {list(shape)}", list(t.shape))
    return shape


def importance_ratios(new_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *, clip_max: float | None = 2.0,
                      clip_min: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, tis_weight)``: ``exp(new - rollout)`` and its detached truncation to ``[clip_min, clip_max]``."""
    _same_shape_floats(new_log_probs=new_log_probs, rollout_log_probs=rollout_log_probs)
    if clip_max is not None and not clip_max > 0:
        raise _problem("clip_max", "> 0 or None", clip_max)
    if clip_min is not None and clip_max is not None and not clip_min <= clip_max:
        raise _problem("clip_min", f"<= clip_max = {clip_max} or None", clip_min)
    ratio = (new_log_probs - rollout_log_probs.detach()).exp()
    tis_weight = ratio.detach().clone()
    if clip_min is not None or clip_max is not None:
        tis_weight = tis_weight.clamp(min=clip_min, max=clip_max)
    return ratio, tis_weight


def _response_index(token_offsets: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    # Token index of every response token: sample i's response starts at tokens_offsets[i+1] - lengths[i];
    # in shard order it starts at cumsum(lengths)[i] - lengths[i]. The difference is one shift per sample.
    response_starts = lengths.cumsum(0) - lengths
    shift = token_offsets[1:] - lengths - response_starts
    return torch.arange(total, device=shift.device) + torch.repeat_interleave(shift, lengths, output_size=total)


def response_token_index(tensors: Mapping[str, Any]) -> torch.Tensor:
    """Index into the shard's flat ``tokens`` of every response token, in shard order, ``[R]`` int64."""
    offsets = torch.as_tensor(tensors["tokens_offsets"]).to(torch.int64)
    lengths = torch.as_tensor(tensors["response_lengths"]).to(torch.int64)
    return _response_index(offsets, lengths, int(lengths.sum()))


def shard_support_log_probs(logits: torch.Tensor, tensors: Mapping[str, Any]) -> torch.Tensor:
    """``support_log_probs`` over a whole shard's response tokens, in shard order, ``[R]``."""
    missing = [k for k in ("tokens", "tokens_offsets", "response_lengths") if k not in tensors]
    if missing:
        raise _problem("tensors", f"a shard's tensors with {missing}", sorted(tensors))
    if _MASK_IDS not in tensors or _MASK_OFFSETS not in tensors:
        raise _problem("tensors", f"a shard with sampling masks ({_MASK_IDS}, {_MASK_OFFSETS})", sorted(tensors))
    tokens, token_offsets, lengths = (_one_d_ints(k, torch.as_tensor(tensors[k]))
                                      for k in ("tokens", "tokens_offsets", "response_lengths"))
    token_offsets, lengths = token_offsets.to(torch.int64), lengths.to(torch.int64)
    samples = lengths.numel()
    if token_offsets.numel() != samples + 1:
        raise _problem("tokens_offsets", f"S+1 = {samples + 1} entries", token_offsets.numel())
    if samples and bool((lengths < 0).any() | (lengths > token_offsets.diff()).any()):
        raise _problem("response_lengths", "in [0, sample token count]", lengths.tolist())
    total = int(lengths.sum())
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != total:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise _problem("logits", f"[R, V] with R = {total} response tokens", got)
    mask_offsets = _one_d_ints(_MASK_OFFSETS, torch.as_tensor(tensors[_MASK_OFFSETS]))
    if mask_offsets.numel() != total + 1:
        raise _problem(_MASK_OFFSETS, f"R+1 = {total + 1} entries", mask_offsets.numel())
    index = _response_index(token_offsets, lengths, total)
    targets = tokens.to(logits.device)[index.to(logits.device)]
    ids = torch.as_tensor(tensors[_MASK_IDS])
    return support_log_probs(logits, targets, ids, mask_offsets)


def _check_loss_inputs(new_log_probs: Any, rollout_log_probs: Any, advantages: Any, loss_mask: Any,
                       old_log_probs: Any, *, clip_eps: float, tis_clip: float) -> None:
    """``grpo_tis_loss``'s arguments: per-token floats of one shape, a 0/1 mask of it, bounds in range."""
    shape = _same_shape_floats(new_log_probs=new_log_probs, rollout_log_probs=rollout_log_probs,
                               advantages=advantages)
    if old_log_probs is not None:
        _same_shape_floats(new_log_probs=new_log_probs, old_log_probs=old_log_probs)
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != shape:
        got = list(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise _problem("loss_mask", f"a tensor of the shape of new_log_probs {list(shape)}", got)
    if loss_mask.numel() and not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
        raise _problem("loss_mask", "0 or 1 everywhere", loss_mask.unique().tolist())
    if not 0 <= clip_eps < 1:
        raise _problem("clip_eps", "in [0, 1)", clip_eps)
    if not tis_clip > 0:
        raise _problem("tis_clip", "> 0", tis_clip)


def grpo_tis_loss(new_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, *, clip_eps: float = 0.2, tis_clip: float = 2.0,
                  old_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO/PPO clipped surrogate, mean over the tokens with ``loss_mask == 1``; ``(loss, stats)``.

    All inputs are per token, ``[R]`` (broadcast a per-sample advantage over its response tokens).
    ``new_log_probs`` must be on the rollout log-probs' basis: over the sampling support
    (``support_log_probs``), at the generator's temperature.

    Without ``old_log_probs`` the rollout policy is the old policy: ``ratio = exp(new - rollout)``
    and the per-token loss is ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``, nothing more.
    A TIS weight on top would be ``min(exp(new - rollout), tis_clip)``, the same ratio again: each
    token would be weighted by about ``ratio ** 2`` and the clip's trust region would no longer
    bound the update. ``tis_clip`` then only sets the diagnostic ``tis_truncated_fraction``: the
    share of masked tokens whose ratio exceeds it (how far off-policy the batch is).

    With ``old_log_probs`` (the trainer's own log-probs at the generating weights, no gradient)
    the two corrections are different and both apply (decoupled PPO + truncated importance
    sampling): ``ratio = exp(new - old)`` is clipped as above, and each token's term is multiplied
    by ``min(exp(old - rollout), tis_clip)``, detached, which corrects the generator/trainer
    mismatch; ``tis_truncated_fraction`` is the share of masked tokens whose weight was truncated.

    Stats (Python floats, over masked tokens; 0.0 when there are none): ``loss``,
    ``mean_abs_log_ratio`` (``|new - old|``, old = rollout without ``old_log_probs``),
    ``clip_fraction`` (tokens where the clipped term is the one taken and differs), and
    ``tis_truncated_fraction``.
    """
    _check_loss_inputs(new_log_probs, rollout_log_probs, advantages, loss_mask, old_log_probs,
                       clip_eps=clip_eps, tis_clip=tis_clip)
    keep = loss_mask.to(torch.bool)
    baseline = (rollout_log_probs if old_log_probs is None else old_log_probs).detach()
    log_ratio = new_log_probs - baseline
    ratio = log_ratio.exp()
    advantages = advantages.detach()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = torch.maximum(unclipped, clipped)  # -min(r * A, clip(r) * A)
    if old_log_probs is None:
        behaviour = ratio.detach()
    else:
        behaviour = (old_log_probs.detach() - rollout_log_probs.detach()).exp()
        per_token = per_token * behaviour.clamp(max=tis_clip)
    count = int(keep.sum())
    loss = torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / max(count, 1)

    def masked_mean(values: torch.Tensor) -> float:
        return float(values[keep].double().mean()) if count else 0.0

    stats = {
        "loss": float(loss.detach()),
        "mean_abs_log_ratio": masked_mean(log_ratio.detach().abs()),
        "clip_fraction": masked_mean((clipped.detach() > unclipped.detach()).to(torch.float64)),
        "tis_truncated_fraction": masked_mean((behaviour > tis_clip).to(torch.float64)),
    }
    return loss, stats


__all__ = ["dense_support_log_probs", "grpo_tis_loss", "importance_ratios", "shard_support_log_probs",
           "support_log_probs"]
