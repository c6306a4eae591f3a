"""Turn samples from a real inference engine's response: SGLang's native ``return_sampling_mask`` shapes.

Contract. ``response`` is what the engine answered, one of:

* ``/generate``: ``{"text", "output_ids", "meta_info": {...}}``; ``output_ids`` (the generated tokens) is
  there with or without ``return_logprob``;
* a chat-completions answer ``{"choices": [...]}`` (its choice ``choice``, default 0) or one choice:
  ``{"message": {"content"}, "completion_token_ids", "meta_info", "finish_reason"}`` (asked with
  ``return_meta_info`` and ``return_completion_token_ids``).

Its ``meta_info`` may hold, per generated token: ``output_token_sampling_mask`` (the support the
top-p/top-k/min-p filter kept, ragged ``[[ids], ...]``), ``output_token_sampling_logprobs`` (the sampled
token's log-prob renormalised over its support, one float), ``output_token_sampling_mask_length`` (the
number of supports), and with ``return_logprob`` ``output_token_logprobs`` (``(log_prob, token_id, ...)``);
``finish_reason`` (``{"type": "length"}`` gives TRUNCATED, ``"abort"`` ABORTED, anything else COMPLETED;
a choice's own string ``finish_reason`` counts too) and ``weight_version`` (the call's weight version).

* The tokens are ``output_ids`` / ``completion_token_ids``, else the ``output_token_logprobs`` ids; when
  both are there they must agree token by token. The behaviour log-prob is the support-renormalised one when
  present, else the ``output_token_logprobs`` one; every log-prob must be finite (0 or below).
* Supports are required unless ``require_mask=False``; ``output_token_sampling_mask_length``, when present,
  must equal the number of tokens; each sampled token must lie in its support; a sample that already has
  supports takes no call without them.
* A call that generated nothing (a prefill-only request, ``max_new_tokens: 0``, or an aborted call with no
  output and no mask fields) appends no token and sets the status.

``append_engine_response(sample, response)`` appends one engine call to a sample in place (as a multi-call
turn grows); ``turn_from_engine_response`` builds a fresh turn sample whose tokens are the given context
followed by the output. Every inconsistency raises ``ContractError`` naming the field and the token
position; nothing is changed when a check fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout_bus.errors import ContractError, must_be
from rollout_bus.model.sample import Sample, Status, is_version_number
from rollout_bus.model.sampling_mask import RolloutSamplingMask

_FINISH_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED}


def engine_output(response: Any, choice: int = 0) -> tuple[Mapping, Mapping, str]:
    """``(output, meta_info, text)`` of a ``/generate`` answer, a chat-completions answer or one of its choices."""
    if not isinstance(response, Mapping):
        raise ContractError(must_be("the engine response", "a JSON object", type(response).__name__))
    output: Any = response
    if "choices" in response:
        choices = response["choices"]
        if not isinstance(choices, Sequence) or not 0 <= choice < len(choices):
            raise ContractError(must_be(f"response['choices'][{choice}]", "present",
                                        f"{len(choices) if isinstance(choices, Sequence) else choices!r} choices"))
        output = choices[choice]
        if not isinstance(output, Mapping):
            raise ContractError(must_be(f"response['choices'][{choice}]", "a JSON object", type(output).__name__))
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping):
        raise ContractError(must_be("response['meta_info']", "a mapping (chat completions: ask with "
                                    "return_meta_info)", type(meta).__name__))
    message = output.get("message")
    text = message.get("content") if isinstance(message, Mapping) else output.get("text")
    return output, meta, text if isinstance(text, str) else ""


def _ints(name: str, values: Any) -> np.ndarray:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ContractError(must_be(name, "a list of token ids", type(values).__name__))
    try:
        return np.array([int(v) for v in values], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ContractError(must_be(name, "a list of token ids", list(values)[:3])) from exc


def _tokens_and_logprobs(output: Mapping, meta: Mapping) -> tuple[np.ndarray, np.ndarray]:
    """The generated tokens and their behaviour log-probs (see the module contract)."""
    named = next(((f"response[{k!r}]", output[k]) for k in ("output_ids", "completion_token_ids")
                  if output.get(k) is not None), None)
    entries = meta.get("output_token_logprobs")
    listed = listed_lp = None
    if entries is not None:
        try:
            listed = np.array([int(item[1]) for item in entries], dtype=np.int64)
            listed_lp = np.array([float(item[0]) for item in entries], dtype=np.float64)
        except (TypeError, ValueError, IndexError) as exc:
            raise ContractError(must_be("meta_info['output_token_logprobs']", "(log_prob, token_id, ...) entries",
                                        list(entries)[:3])) from exc
    if named is not None:
        tokens = _ints(named[0], named[1])
        if listed is not None:
            if listed.size != tokens.size:
                raise ContractError(must_be("len(meta_info['output_token_logprobs'])",
                                            f"len({named[0]}) ({tokens.size})", listed.size))
            differ = np.flatnonzero(listed != tokens)
            if differ.size:
                t = int(differ[0])
                raise ContractError(must_be(f"meta_info['output_token_logprobs'] token at position {t}",
                                            f"{named[0]}'s ({int(tokens[t])})", int(listed[t])))
    elif listed is not None:
        tokens = listed
    else:
        raise ContractError(must_be("the generated tokens", "in response['output_ids'], "
                                    "response['completion_token_ids'] or meta_info['output_token_logprobs']", None))
    native = meta.get("output_token_sampling_logprobs")
    if native is not None:
        log_probs = _aligned("output_token_sampling_logprobs", native, tokens.size)
    elif listed_lp is not None:
        log_probs = listed_lp
    elif tokens.size:
        raise ContractError(must_be("a behaviour log-prob per token", "in meta_info['output_token_sampling_logprobs'] "
                                    "(return_sampling_mask) or meta_info['output_token_logprobs'] (return_logprob)",
                                    None))
    else:
        log_probs = np.empty(0, np.float64)
    bad = np.flatnonzero(~np.isfinite(log_probs) | (log_probs > 1e-6))
    if bad.size:
        t = int(bad[0])
        raise ContractError(must_be(f"behaviour log-prob at position {t}", "finite and at most 0",
                                    float(log_probs[t])))
    return tokens, log_probs


def _aligned(name: str, values: Any, n: int) -> np.ndarray:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ContractError(must_be(f"meta_info[{name!r}]", "one float per generated token", type(values).__name__))
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


def _status(output: Mapping, meta: Mapping) -> Status:
    finish = meta.get("finish_reason", output.get("finish_reason"))
    finish_type = finish.get("type") if isinstance(finish, Mapping) else finish
    return _FINISH_STATUS.get(finish_type, Status.COMPLETED)


def append_engine_response(sample: Sample, response: Mapping, *, require_mask: bool = True,
                           weight_version: str | None = None, choice: int = 0) -> None:
    """Append one engine call's output to ``sample`` (tokens, log-probs, loss mask 1, supports, status)."""
    output, meta, text = engine_output(response, choice)
    tokens, log_probs = _tokens_and_logprobs(output, meta)
    supports = meta.get("output_token_sampling_mask")
    length = meta.get("output_token_sampling_mask_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length != tokens.size):
        raise ContractError(must_be("meta_info['output_token_sampling_mask_length']",
                                    f"the number of generated tokens ({tokens.size})", length))
    if not tokens.size:  # prefill only, or aborted before any token: nothing to append
        sample.status = _status(output, meta)
        return
    if supports is None and require_mask:
        raise ContractError(must_be("meta_info['output_token_sampling_mask']", "present (the engine must return "
                                    "sampling supports: SGLang's return_sampling_mask)", None))
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
    sample.response += text
    if version is not None:
        sample.weight_versions = [*sample.weight_versions, str(version)]
    sample.status = _status(output, meta)


def turn_from_engine_response(response: Mapping, *, context_tokens: Any, template: Sample,
                              require_mask: bool = True, weight_version: str | None = None, choice: int = 0) -> Sample:
    """A fresh turn sample: ``template``'s identity, ``context_tokens`` then the engine's output.

    ``context_tokens`` is everything the engine was given (prompt, earlier turns, observations).
    """
    sample = Sample(group_index=template.group_index, index=template.index, rollout_id=template.rollout_id,
                    prompt=template.prompt, label=template.label, tokens=np.asarray(context_tokens, dtype=np.int64),
                    remove_sample=template.remove_sample, metadata=dict(template.metadata), adapter=template.adapter)
    append_engine_response(sample, response, require_mask=require_mask, weight_version=weight_version, choice=choice)
    sample.validate()
    return sample
