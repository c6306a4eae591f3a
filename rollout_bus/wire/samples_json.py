"""The samples document's JSON: what may go in it, and exactly ``json``'s output, written fast.

Contract (used by ``rollout_bus.wire.codec`` for the ``_samples_meta`` tensor):

* ``json_native(value, name, where, floats)`` returns ``value`` or raises ``CodecError`` for
  what JSON would silently change or cannot hold (non-str keys, tuples, numpy values, nesting
  deeper than ``MAX_JSON_DEPTH``); it appends every float it finds to ``floats``, and every dict
  or list subclass. ``flat(value)``: a dict of str keys and non-float scalars (native for sure).
* ``dump_document(metadata, entries, floats=None) -> bytes`` is byte for byte
  ``json.dumps({"metadata": metadata, "samples": entries}, sort_keys=True, separators=(",", ":"),
  ensure_ascii=False).encode()`` (``CodecError`` for what JSON cannot hold). Long prompt/response
  texts that need no escaping are lifted out and spliced back verbatim. ``floats`` (every float
  in the document and every container subclass, from ``json_native``) lets orjson write the rest
  when it spells each of them as ``json`` does: it writes strings, ints and key order alike and
  refuses what it cannot write (~2x faster than the json module on the short rest, which for
  the same reason also stays small: a long document grows orjson's buffer, and the heap the
  payload is allocated from next, measured in ``bench/codec.py``). ``floats=None``: json writes.
* ``load_document(buffer, begin=0, end=None) -> dict | None`` is ``json.loads(buffer[begin:end])``
  with long sample responses cut out by byte search before parsing, or None when it is not sure
  (the caller then parses plainly).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rollout_bus.errors import CodecError, must_be

try:
    import orjson
except ImportError:  # a declared dependency; without it the json module writes every document
    orjson = None

MAX_JSON_DEPTH = 200
_U8 = np.dtype("u1")
_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# Escaping text costs the JSON encoder ~4 ns a character; a string without quote, backslash or
# control character is written verbatim, so long ones are lifted out, replaced by _MARK (which no
# lifted string can be: it holds control characters) and spliced back as their UTF-8 bytes.
_VERBATIM_MIN = 512
_MARK = "\x00\x01"
_MARK_JSON = _JSON.encode(_MARK)
_MARK_UTF8 = _MARK_JSON.encode("ascii")


_FLAT = frozenset({str, int, bool, type(None)})  # exact scalar types every JSON writer spells alike
_STR = frozenset({str})


def flat(value: Any) -> bool:
    """A dict of str keys and scalars other than floats (most metadata and prompt messages)."""
    return type(value) is dict and {*map(type, value)} <= _STR and {*map(type, value.values())} <= _FLAT


def json_native(value: Any, name: str, where: str, floats: list) -> Any:
    """Refuse what JSON would silently change (non-str keys, tuples, numpy values) or cannot hold.

    Appends to ``floats`` every float found, and any dict or list subclass: ``dump_document``
    lets orjson write only what it spells as json does.
    """
    if flat(value):
        return value
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise CodecError(must_be(name, f"nested at most {MAX_JSON_DEPTH} deep, not circular", "deeper",
                                     where=where))
        if isinstance(node, dict):
            if not all(isinstance(key, str) for key in node):
                raise CodecError(must_be(f"{name} keys", "str", [k for k in node if not isinstance(k, str)][0],
                                         where=where))
            if type(node) is not dict:
                floats.append(node)
            node = node.values()
        elif not isinstance(node, list):
            if node is None or isinstance(node, (str, int, float)):
                continue
            raise CodecError(must_be(name, "JSON-native (dict with str keys, list, str, int, float, bool, None)",
                                     type(node).__name__, where=where))
        elif type(node) is not list:
            floats.append(node)
        floats.extend(child for child in node if isinstance(child, float))
        stack.extend((child, depth + 1) for child in node if not isinstance(child, (str, int, float)))
    return value


def dump_document(metadata: dict, entries: list[dict], floats: list | None = None) -> bytes:
    """The compact, key-sorted UTF-8 JSON of all samples: exactly ``_JSON``'s output, faster."""
    texts: list[bytes] = []
    lifted = [_lift_texts(entry, texts) for entry in entries]
    if floats is not None and orjson is not None and all(map(_spelled_alike, floats)):
        try:
            document = _splice(orjson.dumps({"metadata": metadata, "samples": lifted}, option=orjson.OPT_SORT_KEYS),
                               texts)
            if document is None:  # a lifted text holds a control character (a newline, say): orjson escapes
                document = orjson.dumps({"metadata": metadata, "samples": entries}, option=orjson.OPT_SORT_KEYS)
            return document
        except TypeError:  # an int beyond 64 bits, a lone surrogate, a str subclass as a key: json decides
            pass
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


def _splice(written: bytes, texts: list[bytes]) -> bytes | None:
    """orjson's UTF-8 document with the lifted texts put back; None if one holds a control character
    or _MARK is found elsewhere too (then the document is written whole)."""
    if not texts:
        return written
    pieces = written.split(_MARK_UTF8)
    if len(pieces) != len(texts) + 1:
        return None
    out = [pieces[0]]
    for raw, piece in zip(texts, pieces[1:]):
        out += (b'"', raw, b'"', piece)
    document = b"".join(out)
    return document if np.frombuffer(document, dtype=_U8).min() >= 0x20 else None


def _spelled_alike(value: Any) -> bool:
    """orjson writes this float as ``json`` does (not so for small exponents, NaN and infinities)."""
    return type(value) is float and orjson.dumps(value) == float.__repr__(value).encode()


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
_SCAN = json.JSONDecoder().scan_once  # json.loads without its wrapper: same parser, same results


def load_document(buffer: bytes, begin: int = 0, end: int | None = None) -> dict | None:
    """``json.loads(buffer[begin:end])`` with long sample responses cut out by byte search, or None
    when unsure. The document is read in place (no copy of it, nor of a text before decoding), by
    the parser json.loads calls, without its wrapper (a few microseconds for a short document).

    Scanning text costs the JSON parser ~1 ns a character. In a document without a backslash
    every quote delimits a string, so a response runs to the next quote, and the escape _MARK
    stands in for it unambiguously; a _MARK found anywhere but in a sample's response means
    the search hit something else, and None sends the caller to the plain parser. So does a
    document that is not one JSON value from its first byte to its last (json.loads would skip
    whitespace around it, or refuse it).
    """
    end = len(buffer) if end is None else end
    if buffer.find(b"\\", begin, end) >= 0:
        return None
    spans, at = [], buffer.find(_RESPONSE_KEY, begin, end)
    while at >= 0:
        start = at + len(_RESPONSE_KEY)
        stop = buffer.find(b'"', start, end)
        if stop < 0:
            return None
        if stop - start >= _VERBATIM_MIN:
            spans.append((start, stop))
        at = buffer.find(_RESPONSE_KEY, stop + 1, end)
    if spans and np.frombuffer(buffer, _U8, end - begin, begin).min() < 0x20:  # control characters: json judges
        return None
    view, cuts = memoryview(buffer), [begin, *(at for span in spans for at in span), end]
    try:
        texts = [str(view[start:stop], "utf-8") for start, stop in spans]
        rest = str(_MARK_RAW.join(view[cuts[k]:cuts[k + 1]] for k in range(0, len(cuts), 2)), "utf-8")
        document, stop = _SCAN(rest, 0)
    except (ValueError, RecursionError, StopIteration):
        return None
    samples = document.get("samples") if type(document) is dict else None
    marked = [e for e in samples if type(e) is dict and e.get("response") == _MARK] if type(samples) is list else []
    if stop != len(rest) or len(marked) != len(texts):
        return None
    for entry, text in zip(marked, texts):
        entry["response"] = text
    return document
