"""What a request to an inference engine may ask when its answer is to train: the sampling-support rules.

Why: the trainer recomputes each token's log-prob over the support the engine sampled from; it can do so only
for transformations it knows (temperature, then top-k, top-p and min-p truncation). A penalty, a logit bias or
a custom logit processor changes the distribution in a way the trainer cannot replay, and an untruncated
distribution has no support to return (SGLang answers 400). The check runs before anything is sent.

Contract:

* ``check_sampling_params(params)`` raises ``ConfigError`` naming the parameter: nothing truncates (``top_p``
  1 or absent, ``top_k`` absent or < 1, ``min_p`` 0 or absent); ``frequency_penalty`` or ``presence_penalty``
  other than 0, ``repetition_penalty`` other than 1, a non-empty ``logit_bias``, a ``custom_logit_processor``;
  ``stream`` true (SGLang refuses the mask with streaming). Ranges: ``top_p`` in (0, 1], ``min_p`` in [0, 1),
  ``temperature`` > 0.
* ``generate_request(input_ids, sampling_params, return_logprob=False)``: the body of SGLang's ``/generate``
  (``input_ids``, ``sampling_params``, ``return_sampling_mask: true``), checked.
* ``chat_request(model, messages, sampling_params)``: the body of ``/v1/chat/completions`` with
  ``return_sampling_mask``, ``return_meta_info`` and ``return_completion_token_ids`` (``max_new_tokens``
  is sent as ``max_tokens``), checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_bus.errors import ConfigError, must_be

# the value (or values) each parameter may hold in a run with masks: anything else is a transformation the
# trainer cannot replay
_NEUTRAL = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
            "repetition_penalty": (None, 1, 1.0), "custom_logit_processor": (None,)}


def _number(params: Mapping[str, Any], name: str, default: float) -> float:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(must_be(f"sampling parameter {name}", "a number", value))
    return float(value)


def check_sampling_params(params: Mapping[str, Any]) -> None:
    """Refuse a request whose supports the trainer could not replay (see the module contract)."""
    if not isinstance(params, Mapping):
        raise ConfigError(must_be("sampling params", "a mapping", type(params).__name__))
    top_p, top_k = _number(params, "top_p", 1.0), _number(params, "top_k", -1)
    min_p, temperature = _number(params, "min_p", 0.0), _number(params, "temperature", 1.0)
    if not 0 < top_p <= 1:
        raise ConfigError(must_be("sampling parameter top_p", "in (0, 1]", top_p))
    if not 0 <= min_p < 1:
        raise ConfigError(must_be("sampling parameter min_p", "in [0, 1)", min_p))
    if not temperature > 0:
        raise ConfigError(must_be("sampling parameter temperature", "> 0 (greedy is top_k 1)", temperature))
    if top_p >= 1 and top_k < 1 and min_p <= 0:
        raise ConfigError("sampling params truncate nothing (top_p 1, top_k < 1, min_p 0): there is no support to "
                          "return (SGLang answers 400); set top_p < 1, top_k >= 1 or min_p > 0")
    for name, neutral in _NEUTRAL.items():
        if params.get(name) not in neutral:
            raise ConfigError(f"sampling parameter {name}={params.get(name)!r} changes the distribution in a way "
                              "the trainer cannot replay over the support: leave it unset")
    if params.get("logit_bias"):
        raise ConfigError("sampling parameter logit_bias is set: the trainer cannot replay a biased distribution "
                          "over the support; leave it unset")
    if params.get("stream"):
        raise ConfigError("stream=true with return_sampling_mask: SGLang refuses it (400); request without streaming")


def generate_request(input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                     return_logprob: bool = False) -> dict[str, Any]:
    """The ``/generate`` body that asks for the supports (checked)."""
    check_sampling_params(sampling_params)
    body: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling_params),
                            "return_sampling_mask": True}
    if return_logprob:
        body["return_logprob"] = True
    return body


def chat_request(model: str, messages: Sequence[Mapping[str, Any]], sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that asks for the supports, the meta info and the token ids (checked)."""
    check_sampling_params(sampling_params)
    body: dict[str, Any] = {k: v for k, v in sampling_params.items() if k != "max_new_tokens"}
    if "max_new_tokens" in sampling_params:
        body["max_tokens"] = sampling_params["max_new_tokens"]
    return {**body, "model": model, "messages": [dict(m) for m in messages], "return_sampling_mask": True,
            "return_meta_info": True, "return_completion_token_ids": True}
