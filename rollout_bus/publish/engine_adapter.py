"""Turn samples from a real inference engine's response (SGLang's ``/generate`` shape, as miles reads it).

Contract. A response is ``{"text": str, "meta_info": {...}}`` whose meta info holds:

* ``output_token_logprobs``: one ``(log_prob, token_id, ...)`` entry per generated token (miles
  takes the tokens from ``item[1]`` and the log-probs from ``item[0]``);
* ``output_token_sampling_mask``: one support per generated token, ragged (``[[ids], ...]``),
  the ids the top-p/top-k filter kept; required unless ``require_mask=False``;
* ``output_token_sampling_logprobs`` (optional): the sampled token's log-prob renormalised over
  its support; used as the behaviour log-prob when present, else ``item[0]``;
* ``finish_reason`` (optional): ``{"type": "length"}`` gives TRUNCATED, ``"abort"`` ABORTED, anything
  else COMPLETED; ``weight_version`` (optional) becomes the call's weight version.

``append_engine_response(sample, response)`` appends one engine call to a sample in place (as a
multi-call turn grows); ``turn_from_engine_response`` builds a fresh turn sample whose tokens are
the given context followed by the output. Both check that every per-token list has one entry
per generated token and that each sampled token lies in its support, raising ``ContractError``
naming the token position otherwise; nothing is changed when a check fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import Sample, Status, is_version_number
from rollout_bus.model.sampling_mask import RolloutSamplingMask

_FINISH_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED}


def _meta_of(response: Any) -> Mapping:
    meta = response.get("meta_info") if isinstance(response, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ContractError(must_be("response['meta_info']", "a mapping", type(meta).__name__))
    return meta


def _tokens_and_logprobs(meta: Mapping) -> tuple[np.ndarray, np.ndarray]:
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ContractError(must_be("meta_info['output_token_logprobs']", "present", None))
    try:
        tokens = np.array([int(item[1]) for item in entries], dtype=np.int64)
        log_probs = np.array([float(item[0]) for item in entries], dtype=np.float64)
    except (TypeError, ValueError, IndexError) as exc:
        raise ContractError(must_be("meta_info['output_token_logprobs']", "(log_prob, token_id, ...) entries",
                                    list(entries)[:3])) from exc
    native = meta.get("output_token_sampling_logprobs")
    if native is not None:
        log_probs = _aligned("output_token_sampling_logprobs", native, tokens.size)
    return tokens, log_probs


def _aligned(name: str, values: Sequence[Any], n: int) -> np.ndarray:
    if len(values) != n:
        raise ContractError(must_be(f"len(meta_info[{name!r}])", f"the number of generated tokens ({n})", len(values)))
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ContractError(must_be(f"meta_info[{name!r}]", "one float per generated token", list(values)[:3])) from exc
    if arr.ndim != 1:
        raise ContractError(must_be(f"meta_info[{name!r}]", "one float per generated token", f"shape {arr.shape}"))
    return arr


def _checked_mask(supports: Any, tokens: np.ndarray) -> RolloutSamplingMask:
    """The supports as a mask, after checking one per token, each holding its sampled token."""
    if len(supports) != tokens.size:
        raise ContractError(must_be("len(meta_info['output_token_sampling_mask'])",
                                    f"the number of generated tokens ({tokens.size})", len(supports)))
    try:
        mask = RolloutSamplingMask.from_mask_list(supports)
    except ValueError as exc:
        raise ContractError(f"meta_info['output_token_sampling_mask'] is not a valid support list: {exc}") from exc
    ids, offsets = mask.as_arrays()
    row_of = np.repeat(np.arange(tokens.size), np.diff(offsets))
    found = np.zeros(tokens.size, dtype=bool)
    found[row_of[ids == tokens[row_of]]] = True
    if not found.all():
        t = int(np.argmin(found))
        raise ContractError(must_be(f"sampled token at position {t}",
                                    f"in its sampling support ({mask.row(t).size} ids)", int(tokens[t])))
    return mask


def append_engine_response(sample: Sample, response: Mapping, *, require_mask: bool = True,
                           weight_version: str | None = None) -> None:
    """Append one engine call's output to ``sample`` (tokens, log-probs, loss mask 1, supports, status)."""
    meta = _meta_of(response)
    tokens, log_probs = _tokens_and_logprobs(meta)
    supports = meta.get("output_token_sampling_mask")
    if supports is None and require_mask:
        raise ContractError(must_be("meta_info['output_token_sampling_mask']", "present (the engine must return "
                                    "sampling supports, e.g. SGLang's return_sampling_mask)", None))
    mask = _checked_mask(supports, tokens) if supports is not None else None
    previous = sample.rollout_sampling_mask
    if mask is not None and previous is None and sample.response_length != 0:
        raise ContractError(must_be("sample.response_length", "0 when its first supports arrive",
                                    sample.response_length))
    if mask is None and previous is not None:
        raise ContractError(must_be("meta_info['output_token_sampling_mask']",
                                    "present: the sample already has supports", None))
    n = sample.response_length
    old_loss = np.ones(n, np.int64) if sample.loss_mask is None else np.asarray(sample.loss_mask, np.int64)
    old_lp = np.zeros(n, np.float64) if sample.rollout_log_probs is None else np.asarray(sample.rollout_log_probs)
    version = meta.get("weight_version", weight_version)
    known = sample.rollout_token_versions if n else np.empty(0, np.int64)  # per-token versions so far
    if known is not None and len(known) != n:  # tokens were added by hand without their versions: unknown
        known = None
    if version is not None and is_version_number(str(version)) and known is not None:
        sample.rollout_token_versions = np.concatenate([np.asarray(known, np.int64),
                                                        np.full(tokens.size, int(version), np.int64)])
    else:  # a version that is not a number (or none) makes the per-token versions unknown
        sample.rollout_token_versions = None
    sample.tokens = np.concatenate([np.asarray(sample.tokens, dtype=np.int64), tokens])
    sample.response_length = n + int(tokens.size)
    sample.loss_mask = np.concatenate([old_loss, np.ones(tokens.size, np.int64)])
    sample.rollout_log_probs = np.concatenate([old_lp.astype(np.float64), log_probs])
    if mask is not None:
        sample.rollout_sampling_mask = mask if previous is None else RolloutSamplingMask.concatenate([previous, mask])
    sample.response += str(response.get("text", ""))
    if version is not None:
        sample.weight_versions = [*sample.weight_versions, str(version)]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, Mapping) else finish
    sample.status = _FINISH_STATUS.get(finish_type, Status.COMPLETED)


def turn_from_engine_response(response: Mapping, *, context_tokens: Any, template: Sample,
                              require_mask: bool = True, weight_version: str | None = None) -> Sample:
    """A fresh turn sample: ``template``'s identity, ``context_tokens`` then the engine's output.

    ``context_tokens`` is everything the engine was given (prompt, earlier turns, observations).
    """
    sample = Sample(group_index=template.group_index, index=template.index, rollout_id=template.rollout_id,
                    prompt=template.prompt, label=template.label, tokens=np.asarray(context_tokens, dtype=np.int64),
                    remove_sample=template.remove_sample, metadata=dict(template.metadata), adapter=template.adapter)
    append_engine_response(sample, response, require_mask=require_mask, weight_version=weight_version)
    sample.validate()
    return sample
