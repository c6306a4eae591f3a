"""One record, decoded for a person (rich) or a program (JSON).

Contract:

* ``describe_record(record, kind=None)`` turns a kafka-python record into JSON-ready data: where
  it is, its key, headers and size, then by topic kind (``offsets.topic_kind``, from the name):
  ``turns`` the parsed turn headers and the sample; ``episodes`` the ``EpisodeInfo`` and every
  segment; ``dlq`` the ``dlq.*`` headers and the original record decoded by the kind of its
  source topic (or, when it does not decode, why: that is what a dead letter is for);
  ``metrics`` and ``shards`` the JSON document. A control record (``control`` header: end-of-run,
  abandoned; on any topic) is its JSON value with ``control`` naming its kind, never taken for a
  turn or an episode. An unknown topic is tried as JSON, then as an episode, then as a turn. A sample is described in full: identity (adapter, group_index, index,
  rollout_id, plus attempt and turn from the record), status, reward, every token, the loss mask,
  log-probs, the sampling support as CSR (``ids``/``offsets``), and ``forced``: the response
  positions whose support is the singleton of the token itself (inserted by the environment).
* A record that does not decode as its topic says raises ``CodecError`` naming the position and
  the reason; a dead letter whose original does not decode is not an error.
* ``render(description, console, head=, tail=, rows=)`` prints it compactly: first/last ``head``/
  ``tail`` response tokens with loss mask, forced marker, log-prob and support (at most ``rows``
  ids per row), the loss mask as runs, prompt tokens abbreviated.
* ``inspect_position(client_kwargs, position)`` fetches the record (``offsets.fetch_record``) and
  describes it.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.pretty import Pretty
from rich.table import Table

from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.errors import CodecError, ContractError
from rollout_bus.kafka.reader import fetch_record
from rollout_bus.wire.positions import Position, parse_position, topic_kind
from rollout_bus.wire.episode_record import TURN_FIELDS, decode_episode
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.model.sample import Sample

PREVIEW_BYTES = 64


def _text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + bytes(raw)[:PREVIEW_BYTES].hex() + ("..." if len(raw) > PREVIEW_BYTES else "")


def _plain(arr: Any) -> list | None:
    return None if arr is None else np.asarray(arr).tolist()


def _forced(sample: Sample) -> list[int]:
    """Response positions the environment inserted: support exactly the token itself, loss mask 0.

    A sampled token whose top-p support shrank to one id has the same support but loss 1.
    """
    mask = sample.rollout_sampling_mask
    if mask is None or sample.response_length == 0:
        return []
    ids, offsets = mask.as_arrays()
    response = np.asarray(sample.tokens)[len(sample.tokens) - sample.response_length:]
    singleton = np.diff(offsets) == 1
    starts = offsets[:-1][singleton]
    positions = np.nonzero(singleton)[0]
    positions = positions[ids[starts] == response[positions]]
    if sample.loss_mask is not None:
        positions = positions[np.asarray(sample.loss_mask)[positions] == 0]
    else:
        positions = positions[:0]
    return positions.tolist()


def describe_sample(sample: Sample) -> dict[str, Any]:
    """Everything in one sample, as JSON data."""
    mask = sample.rollout_sampling_mask
    adapter = None if sample.adapter is None else {"name": sample.adapter.name, "slot": sample.adapter.slot}
    return {
        "identity": {"adapter": adapter, "group_index": sample.group_index, "index": sample.index,
                     "rollout_id": sample.rollout_id},
        "status": sample.status.value, "reward": sample.reward, "remove_sample": sample.remove_sample,
        "label": sample.label, "weight_versions": list(sample.weight_versions), "metadata": sample.metadata,
        "prompt": sample.prompt, "response": sample.response,
        "num_tokens": len(sample.tokens), "response_length": int(sample.response_length),
        "effective_response_length": sample.effective_response_length,
        "tokens": _plain(sample.tokens), "loss_mask": _plain(sample.loss_mask),
        "rollout_log_probs": _plain(sample.rollout_log_probs),
        "sampling_mask": None if mask is None else {"ids": _plain(mask.as_arrays()[0]),
                                                    "offsets": _plain(mask.as_arrays()[1])},
        "forced": _forced(sample),
    }


def _headers(headers: Any) -> dict[str, str | None]:
    return {k: _text(v) for k, v in (headers or [])}


def _turn(key: Any, value: bytes | None, headers: Any) -> dict[str, Any]:
    try:
        parsed = TurnHeaders.from_kafka(headers)
        turn_headers: dict[str, Any] = {"turn": parsed.turn, "attempt": parsed.attempt, "final": parsed.final,
                                        "group_size": parsed.group_size, "sent_at_ms": parsed.sent_at_ms}
    except ContractError as exc:
        turn_headers = {"error": str(exc)}
    samples, _ = decode_samples(bytes(value) if value is not None else b"", TURN_FIELDS)
    described = [describe_sample(s) for s in samples]
    for d in described:
        d["identity"].update({k: turn_headers.get(k) for k in ("attempt", "turn")})
    return {"decoded_as": "turns", "turn_headers": turn_headers, "samples": described}


def _episode(key: Any, value: bytes | None, headers: Any) -> dict[str, Any]:
    segments, info = decode_episode(bytes(value) if value is not None else b"")
    described = [describe_sample(s) for s in segments]
    for d in described:
        d["identity"].update({"attempt": info.attempt, "turns": info.turns})
    return {"decoded_as": "episodes", "episode": vars(info).copy(), "samples": described}


def _json(key: Any, value: bytes | None, headers: Any) -> dict[str, Any]:
    try:
        return {"decoded_as": "json", "json": json.loads(bytes(value or b""))}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"value is not JSON: {exc}") from exc


_DECODERS = {"turns": _turn, "episodes": _episode, "metrics": _json, "shards": _json}


def _decode(kind: str | None, key: Any, value: bytes | None, headers: Any) -> dict[str, Any]:
    """Decode by topic kind; an unknown kind tries JSON, an episode, a turn, in that order."""
    control = control_kind(headers)
    if control is not None:
        return {**_json(key, value, headers), "control": control}
    if kind in _DECODERS:
        return _DECODERS[kind](key, value, headers)
    errors = []
    for name in ("metrics", "episodes", "turns"):
        try:
            return _DECODERS[name](key, value, headers)
        except CodecError as exc:
            errors.append(f"as {name}: {exc}")
    raise CodecError("value decodes as nothing known (" + "; ".join(errors) + ")")


def _dead_letter(key: Any, value: bytes | None, headers: Any) -> dict[str, Any]:
    letter = DeadLetter.from_record(key, value, headers)
    source_kind = topic_kind(letter.source.rsplit(":", 2)[0]) if letter.source else None
    out: dict[str, Any] = {"decoded_as": "dlq",
                           "dlq": {"reason": letter.reason, "stage": letter.stage, "kind": letter.kind,
                                   "source": letter.source},
                           "original_headers": _headers(letter.headers)}
    try:
        out["original"] = _decode(source_kind, letter.key, letter.value, letter.headers)
    except CodecError as exc:
        out["original"] = {"decode_error": str(exc), "value_bytes": len(letter.value or b""),
                           "value_preview": repr((letter.value or b"")[:PREVIEW_BYTES])}
    return out


def describe_record(record: Any, kind: str | None = None) -> dict[str, Any]:
    """The record as JSON data (module docstring); CodecError when it does not decode as ``kind``."""
    kind = kind if kind is not None else topic_kind(record.topic)
    where = f"{record.topic}:{record.partition}:{record.offset}"
    head = {"position": where, "topic": record.topic, "partition": record.partition, "offset": record.offset,
            "timestamp_ms": record.timestamp, "kind": kind, "key": _text(record.key),
            "headers": _headers(record.headers), "value_bytes": len(record.value or b"")}
    try:
        decode = _dead_letter if kind == "dlq" else partial(_decode, kind)
        body = decode(record.key, record.value, record.headers)
    except CodecError as exc:
        raise CodecError(f"record {where} does not decode as {kind or 'any known record'}: {exc}") from exc
    return {**head, **body}


def inspect_position(client_kwargs: dict[str, Any], position: Position | str) -> dict[str, Any]:
    """Fetch and describe the record at ``position`` (``TOPIC:PARTITION:OFFSET``)."""
    pos = parse_position(position) if isinstance(position, str) else position
    return describe_record(fetch_record(client_kwargs, pos))


# ---------------------------------------------------------------------------- rendering


def _runs(mask: list[int] | None, n: int) -> str:
    """``1x12 0x5 1x30``: the loss mask as runs."""
    if mask is None:
        return f"none (all {n} trainable)"
    runs: list[list[int]] = []
    for bit in mask:
        if runs and runs[-1][0] == bit:
            runs[-1][1] += 1
        else:
            runs.append([bit, 1])
    shown = " ".join(f"{b}x{c}" for b, c in runs[:24]) + (" ..." if len(runs) > 24 else "")
    return f"{shown} ({sum(mask)}/{len(mask)} trainable)"


def _abbrev(values: list, head: int, tail: int) -> str:
    if len(values) <= head + tail:
        return " ".join(map(str, values))
    return " ".join(map(str, values[:head])) + f" ... ({len(values) - head - tail} more) ... " + \
        " ".join(map(str, values[-tail:]))


def _token_table(d: dict[str, Any], head: int, tail: int, rows: int) -> Table:
    n, tokens = d["response_length"], d["tokens"]
    response = tokens[len(tokens) - n:] if n else []
    forced, mask = set(d["forced"]), d["sampling_mask"]
    table = Table("pos", "token", "loss", "forced", "log-prob", "support", box=None, pad_edge=False)
    shown = list(range(n)) if n <= head + tail else [*range(head), -1, *range(n - tail, n)]
    for t in shown:
        if t < 0:
            table.add_row("...", f"({n - head - tail} more)", "", "", "", "")
            continue
        loss = "1" if d["loss_mask"] is None else str(d["loss_mask"][t])
        logp = "" if d["rollout_log_probs"] is None else f"{d['rollout_log_probs'][t]:.4f}"
        support = ""
        if mask is not None:
            row = mask["ids"][mask["offsets"][t]:mask["offsets"][t + 1]]
            support = f"({len(row)}) " + " ".join(map(str, row[:rows])) + (" ..." if len(row) > rows else "")
        table.add_row(str(t), str(response[t]), loss, "F" if t in forced else "", logp, support)
    return table


def _render_sample(d: dict[str, Any], title: str, console: Console, head: int, tail: int, rows: int) -> None:
    ident = d["identity"]
    adapter = "none" if ident["adapter"] is None else f"{ident['adapter']['name']} (slot {ident['adapter']['slot']})"
    extra = "".join(f"  {k}={ident[k]}" for k in ("attempt", "turn", "turns") if ident.get(k) is not None)
    grid = Table.grid(padding=(0, 2))
    grid.add_row("identity", escape(f"adapter={adapter}  group_index={ident['group_index']}  index={ident['index']}  "
                             f"rollout_id={ident['rollout_id']}{extra}"))
    grid.add_row("status", escape(f"{d['status']}  reward={d['reward']!r}  remove_sample={d['remove_sample']}  "
                                  f"weight_versions={d['weight_versions']}"))
    n = d["response_length"]
    prompt_tokens = d["tokens"][: len(d["tokens"]) - n]
    grid.add_row("tokens", f"{d['num_tokens']} = prompt {len(prompt_tokens)} + response {n} "
                           f"(forced {len(d['forced'])}, trainable {d['effective_response_length']})")
    grid.add_row("prompt tokens", _abbrev(prompt_tokens, head, tail))
    grid.add_row("loss mask", _runs(d["loss_mask"], n))
    grid.add_row("sampling mask", "none" if d["sampling_mask"] is None else
                 f"{len(d['sampling_mask']['ids'])} ids over {n} rows")
    console.print(Panel(grid, title=title, title_align="left"))
    if n:
        console.print(_token_table(d, head, tail, rows))


def _render_body(d: dict[str, Any], console: Console, head: int, tail: int, rows: int) -> None:
    if "decode_error" in d:
        console.print("[red]original value does not decode:[/red] " + escape(d["decode_error"]))
        console.print(escape(f"value ({d['value_bytes']} bytes): {d['value_preview']}"))
        return
    if d["decoded_as"] == "json":
        console.print(Pretty(d["json"]))
        return
    if d["decoded_as"] == "turns":
        console.print(escape(f"turn headers: {d['turn_headers']}"))
    if d["decoded_as"] == "episodes":
        console.print(escape(f"episode: {d['episode']}  segments={len(d['samples'])}"))
    for i, sample in enumerate(d["samples"]):
        _render_sample(sample, f"{d['decoded_as']} sample {i + 1}/{len(d['samples'])}", console, head, tail, rows)


def render(d: dict[str, Any], console: Console, *, head: int = 8, tail: int = 8, rows: int = 6) -> None:
    """Print a ``describe_record`` result for a person."""
    grid = Table.grid(padding=(0, 2))
    grid.add_row("key", escape(str(d["key"])))
    grid.add_row("timestamp_ms", str(d["timestamp_ms"]))
    grid.add_row("value", f"{d['value_bytes']} bytes")
    for name, value in d["headers"].items():
        if d["decoded_as"] == "dlq" and name.startswith("dlq."):
            continue  # shown in the dead-letter panel
        grid.add_row(escape(f"header {name}"), escape(str(value)))
    console.print(Panel(grid, title=escape(f"{d['position']} ({d['kind'] or 'unknown topic'})"), title_align="left"))
    if d["decoded_as"] == "dlq":
        letter = Table.grid(padding=(0, 2))
        for name, value in d["dlq"].items():
            letter.add_row(f"dlq.{name}", escape(str(value)))
        console.print(Panel(letter, title="dead letter", title_align="left", border_style="red"))
        d = d["original"]
    _render_body(d, console, head, tail, rows)
