"""The samples document's JSON, fast for long texts: exactly ``json``'s output, or a plain fallback.

Contract (used by ``rollout_bus.codec`` for the ``_samples_meta`` tensor):

* ``dump_document(metadata, entries) -> bytes`` is byte for byte
  ``json.dumps({"metadata": metadata, "samples": entries}, sort_keys=True, separators=(",", ":"),
  ensure_ascii=False).encode()``; long prompt/response texts that need no escaping are written
  verbatim instead of through the encoder's escaping (``CodecError`` for what JSON cannot hold).
* ``load_document(raw) -> dict | None`` is ``json.loads(raw)`` with long sample responses cut out
  by byte search before parsing, or None when it is not sure (the caller then parses plainly).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rollout_bus.errors import CodecError

_U8 = np.dtype("u1")
_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# Escaping text costs the JSON encoder ~4 ns a character; a string without quote, backslash or
# control character is written verbatim, so long ones are lifted out, replaced by _MARK (which no
# lifted string can be: it holds control characters) and spliced back as their UTF-8 bytes.
_VERBATIM_MIN = 512
_MARK = "\x00\x01"
_MARK_JSON = _JSON.encode(_MARK)


def dump_document(metadata: dict, entries: list[dict]) -> bytes:
    """The compact, key-sorted UTF-8 JSON of all samples: exactly ``_JSON``'s output, faster."""
    texts: list[bytes] = []
    lifted = [_lift_texts(entry, texts) for entry in entries]
    try:
        if texts:
            pieces = _JSON.encode({"metadata": metadata, "samples": lifted}).split(_MARK_JSON)
            if len(pieces) == len(texts) + 1:  # else some other string holds _MARK: write it all plainly
                out = [pieces[0].encode("utf-8")]
                for raw, piece in zip(texts, pieces[1:]):
                    out += (b'"', raw, b'"', piece.encode("utf-8"))
                document = b"".join(out)
                # The encoder writes no raw control character: one here is in a lifted text.
                if np.frombuffer(document, dtype=_U8).min() >= 0x20:
                    return document
        return _JSON.encode({"metadata": metadata, "samples": entries}).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodecError(f"samples metadata cannot be written as JSON: {exc}") from exc


def _lift_texts(entry: dict, texts: list[bytes]) -> dict:
    """A copy of ``entry`` with long verbatim texts as _MARK, appended to ``texts`` in JSON order.

    Sorted keys put ``prompt`` (a string, or messages whose ``content`` is one) before ``response``.
    """
    prompt, response = entry["prompt"], _verbatim(entry["response"])
    if type(prompt) is str:
        raw = _verbatim(prompt)
        if raw is not None:
            texts.append(raw)
            prompt = _MARK
    else:  # a list of messages
        before = len(texts)
        messages = [_lift_content(m, texts) for m in prompt]
        prompt = messages if len(texts) > before else prompt
    if response is not None:
        texts.append(response)
    if prompt is entry["prompt"] and response is None:
        return entry
    return {**entry, "prompt": prompt, "response": _MARK if response is not None else entry["response"]}


def _lift_content(message: dict, texts: list[bytes]) -> dict:
    raw = _verbatim(message.get("content")) if type(message) is dict else None
    if raw is None:
        return message
    texts.append(raw)
    return {**message, "content": _MARK}


def _verbatim(text: Any) -> bytes | None:
    """``text`` as UTF-8 when it is long and has no quote or backslash (control characters are
    looked for once in the whole document)."""
    if type(text) is not str or len(text) < _VERBATIM_MIN or '"' in text or "\\" in text:
        return None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the plain encoder reports it
        return None


_MARK_RAW = _MARK_JSON[1:-1].encode("ascii")
_RESPONSE_KEY = b'"response":"'


def load_document(raw: bytes) -> dict | None:
    """``json.loads(raw)`` with long sample responses cut out by byte search, or None when unsure.

    Scanning text costs the JSON parser ~1 ns a character. In a document without a backslash
    every quote delimits a string, so a response runs to the next quote, and the escape _MARK
    stands in for it unambiguously; a _MARK found anywhere but in a sample's response means
    the search hit something else, and None sends the caller to the plain parser.
    """
    if b"\\" in raw:
        return None
    spans, at = [], raw.find(_RESPONSE_KEY)
    while at >= 0:
        begin = at + len(_RESPONSE_KEY)
        end = raw.find(b'"', begin)
        if end < 0:
            return None
        if end - begin >= _VERBATIM_MIN:
            spans.append((begin, end))
        at = raw.find(_RESPONSE_KEY, end + 1)
    if not spans or np.frombuffer(raw, dtype=_U8).min() < 0x20:  # control characters: let json.loads judge
        return None
    cuts = [0, *(at for span in spans for at in span), len(raw)]
    try:
        texts = [raw[begin:end].decode("utf-8") for begin, end in spans]
        document = json.loads(_MARK_RAW.join(raw[cuts[k]:cuts[k + 1]] for k in range(0, len(cuts), 2)).decode())
    except (ValueError, RecursionError):
        return None
    samples = document.get("samples") if type(document) is dict else None
    marked = [e for e in samples if type(e) is dict and e.get("response") == _MARK] if type(samples) is list else []
    if len(marked) != len(texts):
        return None
    for entry, text in zip(marked, texts):
        entry["response"] = text
    return document
