"""Multi-turn episodes: forced tokens and the merging of turns (docs/data-model.md section 3).

Contract:

* ``append_forced_sampling_tokens(sample, token_ids)`` gives every token the environment inserts
  (tool calls, observations) a singleton support holding the token itself, by replacing
  ``sample.rollout_sampling_mask``. Only the mask changes: the caller extends ``tokens`` and
  ``response_length`` afterwards.
* ``merge_sampling_masks(first, observation_token_ids, second)`` joins two turns' masks with
  singleton rows for the observation between them; exactly one missing mask is incomplete
  replay data and raises instead of merging silently.
* ``merge_sample_pair(a, b)`` merges a turn ``b`` that continues ``a`` into one sample (the
  observation tokens get loss 0, log-prob 0.0 and singleton supports); ``merge_samples``
  folds a whole episode and starts a new sibling segment where a turn cannot be appended
  (the accumulated turn is not COMPLETED, the history was compacted, or a replay gap).
* Interrupted turns: a turn ABORTED mid-response (new weights went live; the engine returned the
  tokens so far) is continued by the next turn record, whose tokens are the aborted turn's followed
  directly by the rest of the response: nothing is inserted between them, and the merge gives the
  same tokens, loss mask, log-probs and masks as the uninterrupted turn would have.
* ``split_turn(sample, at, old_version, new_version)`` -> ``(aborted, continuation)``: a turn whose first
  ``at`` response tokens (``0 < at < response_length``) were generated under ``old_version`` and the rest
  under ``new_version``, as the two records an engine that swapped weights mid-turn sends: the aborted
  part (status ABORTED, no reward, versions ``old_version``, ``weight_versions`` ``[old_version]``) and its
  continuation (the whole context, the rest of the response and its per-token fields, status and reward,
  versions ``new_version``). Merging them gives the input back exactly; only the versions show the change.
* ``rollout_token_versions`` (per response token, -1 for tokens not generated) are concatenated,
  with -1 for the observation tokens; when any merged turn lacks them the segment has none.
* Inputs are never mutated. Merged token data is held in numpy arrays (tokens and loss mask
  int64, log-probs float64). Every contract violation raises ``ContractError`` (a ``ValueError``).

Decisions where the contract is silent: log-probs stay None when neither turn has them (a turn
without them among turns with them contributes 0.0s, as in miles); the merged ``prompt`` is the
first turn's, ``reward`` is the last turn's, ``metadata`` is the union (later turns win), and
``response`` is the turns' texts joined, with the observation decoded only when a tokenizer is given.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask, SamplingMaskBuilder

IDENTITY_FIELDS = ("group_index", "index", "rollout_id", "adapter", "label", "remove_sample")
REPLAY_FIELDS = ("rollout_sampling_mask",)


def _forced_mask(token_ids: Any) -> RolloutSamplingMask:
    builder = SamplingMaskBuilder()
    builder.append_forced(token_ids)
    return builder.build()


def append_forced_sampling_tokens(sample: Sample, token_ids: Any) -> None:
    """Record singleton supports for tokens that were inserted, not sampled; call before extending the response.
    Per-token versions, when the sample has them, get -1 for these tokens (no model generated them)."""
    mask = sample.rollout_sampling_mask
    forced = _forced_mask(token_ids)
    versions = sample.rollout_token_versions
    if versions is not None and len(versions) != sample.response_length:
        raise ContractError(must_be("len(rollout_token_versions)", f"response_length={sample.response_length} "
                                    "before appending", len(versions)))
    _append_forced_rows(sample, mask, forced)
    if versions is not None:  # only once the mask took the rows: a refusal leaves the sample as it was
        sample.rollout_token_versions = np.concatenate([np.asarray(versions, np.int64),
                                                        np.full(len(forced), -1, np.int64)])


def _append_forced_rows(sample: Sample, mask: RolloutSamplingMask | None, forced: RolloutSamplingMask) -> None:
    if mask is None:
        if sample.response_length != 0:
            raise ContractError(
                must_be("response_length", "0 when the sample has no sampling mask yet "
                        "(a mask cannot start after response tokens exist)", sample.response_length)
            )
        sample.rollout_sampling_mask = forced
        return
    if len(mask) != sample.response_length:
        raise ContractError(
            must_be("len(rollout_sampling_mask)", f"response_length={sample.response_length} before appending",
                    len(mask))
        )
    sample.rollout_sampling_mask = RolloutSamplingMask.concatenate([mask, forced])


def _mask_of(value: Any, name: str) -> RolloutSamplingMask | None:
    """Accept a Sample (miles passes samples) or a mask / None directly."""
    if isinstance(value, Sample):
        value = value.rollout_sampling_mask
    if value is not None and not isinstance(value, RolloutSamplingMask):
        raise ContractError(must_be(name, "a Sample, a RolloutSamplingMask or None", type(value).__name__))
    return value


def merge_sampling_masks(first: Any, observation_token_ids: Any, second: Any) -> RolloutSamplingMask | None:
    """``first`` + singleton rows for the observation + ``second``; None when neither has a mask.

    ``first`` and ``second`` are turns (Samples) or their masks.
    """
    first_mask, second_mask = _mask_of(first, "first"), _mask_of(second, "second")
    if first_mask is None and second_mask is None:
        return None
    if first_mask is None or second_mask is None:
        missing = "first" if first_mask is None else "second"
        raise ContractError(
            must_be(f"{missing} rollout_sampling_mask", "present on both turns (replay data incomplete)", None)
        )
    builder = SamplingMaskBuilder(first_mask.num_ids + second_mask.num_ids, len(first_mask) + len(second_mask))
    builder.extend(first_mask)
    builder.append_forced(observation_token_ids)
    builder.extend(second_mask)
    return builder.build()


def _as_tokens(tokens: Any) -> np.ndarray:
    arr = np.asarray(tokens)
    return arr.astype(np.int64) if arr.size == 0 else arr


def _continues(a_tokens: np.ndarray, b_tokens: np.ndarray) -> bool:
    """Whether ``b_tokens`` starts with ``a_tokens``."""
    n = a_tokens.size
    return b_tokens.size >= n and bool(np.array_equal(b_tokens[:n], a_tokens))


class _Segment:
    """One sibling segment being merged: per-token parts are collected and joined once at the end."""

    def __init__(self, first: Sample, tokenizer: Any = None) -> None:
        first.validate()
        self.first = first
        self.last = first
        self.tokenizer = tokenizer
        self.count = 1
        self.response_length = first.response_length
        self.loss_parts = [self._loss_of(first)]
        self.logprob_parts: list[np.ndarray | None] = [self._logprobs_of(first)]
        self.has_logprobs = first.rollout_log_probs is not None
        self.version_parts: list[np.ndarray] | None = self._versions_of(first)
        self.mask: SamplingMaskBuilder | None = None
        if first.rollout_sampling_mask is not None:
            self.mask = SamplingMaskBuilder()
            self.mask.extend(first.rollout_sampling_mask)
        self.responses = [first.response]
        self.weight_versions = list(first.weight_versions)
        self.metadata = dict(first.metadata)

    @staticmethod
    def _loss_of(sample: Sample) -> np.ndarray:
        if sample.loss_mask is None:
            return np.ones(sample.response_length, dtype=np.int64)
        return np.asarray(sample.loss_mask, dtype=np.int64)

    @staticmethod
    def _logprobs_of(sample: Sample) -> np.ndarray | None:
        if sample.rollout_log_probs is None:
            return None
        return np.asarray(sample.rollout_log_probs, dtype=np.float64)

    @staticmethod
    def _versions_of(sample: Sample) -> list[np.ndarray] | None:
        if sample.rollout_token_versions is None:
            return None
        return [np.asarray(sample.rollout_token_versions, dtype=np.int64)]

    def stop_reason(self, b: Sample) -> str | None:
        """Why ``b`` must start a new segment (None: it can be merged)."""
        if self.last.status == Status.ABORTED:  # merged only with its continuation (nothing inserted)
            a_tokens, b_tokens = _as_tokens(self.last.tokens), _as_tokens(b.tokens)
            if not (_continues(a_tokens, b_tokens) and b_tokens.size - a_tokens.size == b.response_length):
                return "previous turn not completed"
        elif self.last.status != Status.COMPLETED:
            return "previous turn not completed"
        if not _continues(_as_tokens(self.last.tokens), _as_tokens(b.tokens)):
            return "tokens compacted"
        if any(getattr(self.last, f) is not None and getattr(b, f) is None for f in REPLAY_FIELDS):
            return "replay gap"
        return None

    def extend(self, b: Sample) -> None:
        """Merge turn ``b`` that continues the segment; raises ContractError when it cannot."""
        b.validate()
        for name in IDENTITY_FIELDS:
            mine, theirs = getattr(self.first, name), getattr(b, name)
            if mine != theirs:
                raise ContractError(must_be(name, f"equal on both turns (first has {mine!r})", theirs))
        a_tokens, b_tokens = _as_tokens(self.last.tokens), _as_tokens(b.tokens)
        if not _continues(a_tokens, b_tokens):
            raise ContractError(must_be("b.tokens", f"a continuation of a.tokens (len {a_tokens.size})",
                                        f"len {b_tokens.size}, different prefix"))
        obs_len = b_tokens.size - a_tokens.size - b.response_length
        interrupted = self.last.status == Status.ABORTED  # b continues the aborted response: nothing between
        if interrupted and obs_len != 0:
            raise ContractError(must_be("obs_len after an ABORTED turn", "0 (its continuation adds only response "
                                        "tokens)", obs_len))
        if not interrupted and obs_len <= 0:
            raise ContractError(must_be("obs_len", "> 0 (len(b.tokens) - len(a.tokens) - b.response_length)", obs_len))
        observation = b_tokens[a_tokens.size : a_tokens.size + obs_len]
        self._extend_mask(b, observation)
        self.loss_parts += [np.zeros(obs_len, dtype=np.int64), self._loss_of(b)]
        self.logprob_parts += [np.zeros(obs_len, dtype=np.float64), self._logprobs_of(b)]
        self.has_logprobs = self.has_logprobs or b.rollout_log_probs is not None
        theirs = self._versions_of(b)
        self.version_parts = None if self.version_parts is None or theirs is None else \
            [*self.version_parts, np.full(obs_len, -1, dtype=np.int64), *theirs]
        obs_text = self.tokenizer.decode(observation.tolist()) if self.tokenizer is not None else ""
        self.responses += [obs_text, b.response]
        self.response_length += obs_len + b.response_length
        self.weight_versions += list(b.weight_versions)
        self.metadata.update(b.metadata)
        self.last = b
        self.count += 1

    def _extend_mask(self, b: Sample, observation: np.ndarray) -> None:
        if self.mask is None and b.rollout_sampling_mask is None:
            return
        if self.mask is None or b.rollout_sampling_mask is None:
            missing = "first" if self.mask is None else "second"
            raise ContractError(
                must_be(f"{missing} rollout_sampling_mask", "present on both turns (replay data incomplete)", None)
            )
        self.mask.append_forced(observation)
        self.mask.extend(b.rollout_sampling_mask)

    def finish(self) -> Sample:
        """The merged sample (a copy of the single turn when nothing was merged)."""
        if self.count == 1:
            single = copy.copy(self.first)
            single.weight_versions = list(single.weight_versions)
            single.metadata = dict(single.metadata)
            return single
        log_probs = None
        if self.has_logprobs:
            log_probs = np.concatenate(self._filled_logprobs())
        return Sample(
            group_index=self.first.group_index, index=self.first.index, rollout_id=self.first.rollout_id,
            prompt=self.first.prompt, tokens=np.array(self.last.tokens, dtype=np.int64),
            response="".join(self.responses), response_length=self.response_length, label=self.first.label,
            reward=copy.deepcopy(self.last.reward), loss_mask=np.concatenate(self.loss_parts),
            weight_versions=self.weight_versions, rollout_log_probs=log_probs,
            rollout_sampling_mask=self.mask.build() if self.mask is not None else None,
            remove_sample=self.first.remove_sample, status=self.last.status, metadata=self.metadata,
            adapter=self.first.adapter,
            rollout_token_versions=np.concatenate(self.version_parts) if self.version_parts is not None else None,
        )

    def _filled_logprobs(self) -> list[np.ndarray]:
        """Turns without log-probs contribute 0.0 per token (their length is their loss part's)."""
        return [p if p is not None else np.zeros(loss.size) for p, loss in zip(self.logprob_parts, self.loss_parts)]


def merge_sample_pair(a: Sample, b: Sample, *, tokenizer: Any = None) -> Sample:
    """Merge turn ``b`` that continues turn ``a`` into one sample; neither input is changed."""
    segment = _Segment(a, tokenizer)
    segment.extend(b)
    return segment.finish()


def merge_samples(samples: Sequence[Sample], *, tokenizer: Any = None) -> list[Sample]:
    """Fold an episode's turns in order into sibling segments (usually one)."""
    segments: list[Sample] = []
    current: _Segment | None = None
    for sample in samples:
        if current is not None and current.stop_reason(sample) is None:
            current.extend(sample)
            continue
        if current is not None:
            segments.append(current.finish())
        current = _Segment(sample, tokenizer)
    if current is not None:
        segments.append(current.finish())
    return segments


def _mask_suffix(mask: RolloutSamplingMask, at: int) -> RolloutSamplingMask:
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
        continuation.rollout_sampling_mask = _mask_suffix(sample.rollout_sampling_mask, at)
    aborted.validate()
    continuation.validate()
    return aborted, continuation
