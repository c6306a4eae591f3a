"""A turn interrupted by new weights: the aborted partial turn and its continuation.

When new weights go live mid-turn, engines abort the request and return the tokens generated so
far (SkyRL, NeMo-RL partial rollouts); the next request continues the same response under the new
weights. On the bus that is two turn records of one attempt: the partial one (status ABORTED, not
final) and its continuation, whose tokens are the partial turn's followed directly by the rest of
the response. The stream stage's merge (``rollout_bus.model.turns``) folds them back into one response.

Contract: ``split_turn(sample, at, old_version, new_version)`` returns ``(aborted, continuation)``
for a turn whose first ``at`` response tokens (``0 < at < response_length``) were generated under
``old_version`` and the rest under ``new_version``: the aborted turn holds the prompt, context and
those tokens, with every per-token field cut to them, status ABORTED, no reward, per-token versions
``old_version`` (-1 stays -1) and ``weight_versions`` ``[old_version]``; the continuation holds the
whole context and the rest of the response with its per-token fields, status and reward, per-token
versions ``new_version`` and ``weight_versions`` ``[new_version]``. Merging them gives the input's tokens, loss
mask, log-probs and sampling mask exactly; only the versions show the change. ``interruption_point``
picks a seeded split before a generated token (never inside tool output), or None.
"""

from __future__ import annotations

import copy

import numpy as np

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask


def interruption_point(sample: Sample, rng: np.random.Generator) -> int | None:
    """A split before a generated response token other than the first, or None when there is none."""
    mask = np.asarray(sample.loss_mask if sample.loss_mask is not None else np.ones(sample.response_length), np.int64)
    candidates = np.flatnonzero(mask[1:] == 1) + 1
    return int(rng.choice(candidates)) if candidates.size else None


def _suffix(mask: RolloutSamplingMask, at: int) -> RolloutSamplingMask:
    ids, offsets = mask.as_arrays()
    return RolloutSamplingMask.from_mask_list([ids[offsets[t]:offsets[t + 1]] for t in range(at, len(mask))])


def split_turn(sample: Sample, at: int, old_version: int, new_version: int) -> tuple[Sample, Sample]:
    """The aborted partial turn and its continuation (see the module docstring)."""
    rl = sample.response_length
    if not 0 < at < rl:
        raise ContractError(must_be("interruption point", f"in (0, response_length={rl})", at))
    versions = None
    if sample.rollout_token_versions is not None:
        versions = np.asarray(sample.rollout_token_versions, np.int64).copy()
        versions[:at] = np.where(versions[:at] >= 0, old_version, -1)
        versions[at:] = np.where(versions[at:] >= 0, new_version, -1)
    aborted = copy.deepcopy(sample)
    aborted.rollout_token_versions = versions.copy() if versions is not None else None
    aborted.strip_last_output_tokens(rl - at)
    aborted.status, aborted.reward, aborted.weight_versions = Status.ABORTED, None, [str(old_version)]
    continuation = copy.deepcopy(sample)
    continuation.response_length = rl - at
    for name in ("loss_mask", "rollout_log_probs"):
        value = getattr(sample, name)
        setattr(continuation, name, None if value is None else np.asarray(value)[at:].copy())
    continuation.rollout_token_versions = versions[at:] if versions is not None else None
    continuation.weight_versions = [str(new_version)]
    if sample.rollout_sampling_mask is not None:
        continuation.rollout_sampling_mask = _suffix(sample.rollout_sampling_mask, at)
    aborted.validate()
    continuation.validate()
    return aborted, continuation
