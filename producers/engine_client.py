"""From a real inference engine to the bus: ask SGLang for a turn with its supports, publish it.

Why: the native ``return_sampling_mask`` is one request field, but a generator must also send only what the
trainer can replay, read every answer shape, and never publish a half-read answer. This is the smallest
client that does all of it, on the standard library's HTTP (no new dependency).

Contract:

* ``EngineClient(base_url, timeout_s=120)``: ``post(path, body)`` sends JSON and returns the parsed answer;
  an HTTP error status is an ``EngineError`` naming the URL, the status and the engine's message (4xx: an
  ``EngineRefused``, the request itself is wrong); no answer
  (refused, cut mid-response, timed out, not JSON) is an ``EngineError`` saying so. ``generate(input_ids,
  sampling_params)`` posts ``engine_request.generate_request``; ``chat(model, messages, sampling_params)``
  posts ``engine_request.chat_request``. Both check the sampling params first (``ConfigError``, nothing sent).
* ``publish_from_engine(client, publisher, *, template, context_tokens, sampling_params, turn, final,
  group_size, attempt=0, weight_version=None)``: one ``/generate`` call on ``context_tokens``, its answer
  turned into a turn sample (``engine_adapter.turn_from_engine_response``: every check, or ``ContractError``)
  and published with ``publisher.publish_turn``; returns the sample. Nothing is published when any step fails.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_bus.errors import EngineError, EngineRefused
from rollout_bus.model.sample import Sample
from rollout_bus.producers.engine_adapter import turn_from_engine_response
from rollout_bus.producers.engine_request import chat_request, generate_request


class EngineClient:
    """JSON over HTTP to one engine (SGLang's server, or a router in front of a fleet)."""

    def __init__(self, base_url: str, *, timeout_s: float = 120.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), float(timeout_s)

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        url = self.base_url + path
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            text = f"{url} answered {exc.code}: {_message(exc.read())}"
            raise (EngineRefused(text, exc.code) if 400 <= exc.code < 500 else EngineError(text)) from exc
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise EngineError(f"{url} did not answer ({type(exc).__name__}: {reason}): nothing published "
                              "for this call") from exc
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise EngineError(f"{url} answered something that is not JSON ({len(raw)} bytes: {raw[:80]!r})") from exc

    def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                 return_logprob: bool = False) -> Any:
        return self.post("/generate", generate_request(input_ids, sampling_params, return_logprob=return_logprob))

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]], sampling_params: Mapping[str, Any]) -> Any:
        return self.post("/v1/chat/completions", chat_request(model, messages, sampling_params))


def _message(raw: bytes) -> str:
    """The engine's own error message (OpenAI-style ``{"message": ...}`` or ``{"error": {"message": ...}}``)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace") or "(no body)"
    if isinstance(doc, Mapping):
        inner = doc.get("error") if isinstance(doc.get("error"), Mapping) else doc
        if isinstance(inner.get("message"), str):
            return inner["message"]
    return json.dumps(doc)[:200]


def publish_from_engine(client: EngineClient, publisher: Any, *, template: Sample, context_tokens: Sequence[int],
                        sampling_params: Mapping[str, Any], turn: int, final: bool, group_size: int,
                        attempt: int = 0, weight_version: str | None = None) -> Sample:
    """One engine call on ``context_tokens``, published as turn ``turn`` (see the module contract)."""
    response = client.generate(context_tokens, sampling_params)
    sample = turn_from_engine_response(response, context_tokens=context_tokens, template=template,
                                       weight_version=weight_version)
    publisher.publish_turn(sample, turn=turn, final=final, attempt=attempt, group_size=group_size)
    return sample
