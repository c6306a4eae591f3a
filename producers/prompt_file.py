"""A user's prompt file (JSONL or Parquet) read into prompt groups, every line checked before anything is sent.

Why: ``rollout-bus prompts load FILE`` puts a user's own prompts on rollout.prompts; a bad line found halfway
through a load would leave the run with half a file. So the whole file is read and checked here first, with no
broker in sight, and a loader only ever sees valid ``PromptLine``s. Pure: reads one file (and a local tokenizer).

Contract:

* ``read_prompt_file(path, options)``: by suffix, ``.jsonl``/``.json`` (one JSON object a line; blank lines are
  skipped) or ``.parquet`` (one object a row; pyarrow is imported only then). Each line gives one ``PromptLine``,
  in file order. The fields of a line (as miles' ``--input-key``/``--label-key``):

  - ``options.prompt_key`` (default ``prompt``): a string of text, or a list of chat messages
    (``[{"role": ..., "content": ...}]``); or instead ``input_ids``, a non-empty list of token ids used as given
    (not both). Text and messages need ``options.tokenizer_dir``, a local Hugging Face tokenizer directory
    (``AutoTokenizer.from_pretrained(dir, local_files_only=True)``: never a hub download; transformers is
    imported only when a tokenizer is given): text is tokenized as the engine would (the tokenizer's special tokens added), messages
    are rendered by its chat template with ``add_generation_prompt=True`` and the rendering tokenized without
    adding special tokens again (the template has them). The record keeps ``text`` (the text or the rendering)
    and ``tokenizer`` (the directory's basename).
  - ``options.label_key`` (default ``label``): any JSON value, or absent (null).
  - optional ``n_samples`` (integer >= 1), ``sampling`` (an object of temperature/top_p/top_k/min_p/
    max_new_tokens), ``adapter`` (a string), ``metadata`` (an object) and ``id`` (a string of 1-256 bytes). A
    missing or null one takes the default: ``options.n_samples``, ``options.adapter``, ``{}``, and for ``id``
    ``prompt_id(content)``, the hash of the line's canonical content (every field but ``id`` and
    ``group_index``), so the same line loaded twice has the same id. Other fields are ignored.

* Refused, as a ``ConfigError`` that names the file and line (``prompts.jsonl:7: ...``; Parquet counts rows from
  0: ``prompts.parquet row 6: ...``): a line that is not JSON or not an object, a missing or wrongly typed
  field, text or messages without a tokenizer, a prompt that tokenizes to nothing, empty ``input_ids``, a value
  JSON cannot hold (NaN, bytes), and an id used twice in the file (naming both lines). Also an unknown suffix,
  a file that cannot be read, and a tokenizer directory that is not one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_bus.errors import ConfigError, ContractError
from rollout_bus.wire.prompt_record import SAMPLING_KEYS, PromptGroup, prompt_id

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
INPUT_IDS_KEY = "input_ids"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a Hugging Face tokenizer directory has one
DEFAULT_N_SAMPLES = 4  # as `rollout-bus generate --n-samples-per-prompt`


@dataclass(frozen=True)
class PromptFileOptions:
    """How to read a prompt file: which fields hold the prompt and label, the tokenizer, the defaults."""

    prompt_key: str = "prompt"
    label_key: str = "label"
    tokenizer_dir: Path | None = None
    n_samples: int = DEFAULT_N_SAMPLES
    adapter: str | None = None


@dataclass(frozen=True)
class PromptLine:
    """One checked line: its id, where it was (``prompts.jsonl:7``), and its prompt group's fields but ``id``
    and ``group_index`` (which a loader gives at send time)."""

    id: str
    where: str
    content: dict[str, Any] = field(repr=False)

    def group(self, group_index: int) -> PromptGroup:
        return PromptGroup(id=self.id, group_index=group_index, **self.content)


class _Tokenizer:
    """A local Hugging Face tokenizer, loaded once; text and chat messages to token ids."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise ConfigError(f"--tokenizer {directory}: not a directory (a local Hugging Face tokenizer "
                              "directory: tokenizer.json, tokenizer_config.json)")
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(f"--tokenizer {directory}: not a tokenizer directory (none of "
                              f"{', '.join(TOKENIZER_FILES)} in it)")
        from transformers import AutoTokenizer  # only when a file needs it: the import takes seconds

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # transformers fails a wrong directory in many ways (OSError, ValueError, and
            # an ImportError from its own except clause when protobuf is missing): each means "not a tokenizer"
            raise ConfigError(f"--tokenizer {directory}: not a tokenizer directory ({_first_line(exc)})") from exc
        self.name = directory.resolve().name

    def text_ids(self, text: str) -> list[int]:
        return list(self._tokenizer(text)["input_ids"])

    def render(self, messages: list[dict[str, Any]]) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {self.name!r} has no chat template, so chat messages cannot be "
                             "rendered (give the prompt as text or input_ids)")
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template is the user's Jinja: any error it raises is about their input
            raise ValueError(f"the chat template of {self.name!r} failed on these messages: "
                             f"{_first_line(exc)}") from exc

    def rendered_ids(self, rendered: str) -> list[int]:
        return list(self._tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def read_prompt_file(path: Path | str, options: PromptFileOptions = PromptFileOptions()) -> list[PromptLine]:
    """Every line of the file as a checked ``PromptLine``, in file order (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise ConfigError(f"{path}: unknown prompt file type {suffix or '(no suffix)'!r}: give a JSON lines file "
                          f"({', '.join(JSONL_SUFFIXES)}) or a Parquet file (.parquet)")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    tokenizer = _Tokenizer(Path(options.tokenizer_dir)) if options.tokenizer_dir is not None else None
    rows = _parquet_rows(path) if suffix in PARQUET_SUFFIXES else _jsonl_rows(path)
    lines: list[PromptLine] = []
    first_seen: dict[str, str] = {}
    for where, row in rows:
        try:
            line = _prompt_line(where, row, options, tokenizer)
        except (ContractError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        if line.id in first_seen:
            raise ConfigError(f"{where}: id {line.id!r} is also the id of {first_seen[line.id]} (each prompt "
                              "group of a file needs its own id)")
        first_seen[line.id] = where
        lines.append(line)
    return lines


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, parsed line)`` for each non-blank line; ``ConfigError`` at the first that is not JSON."""
    try:
        with path.open("r", encoding="utf-8") as lines:
            for number, text in enumerate(lines, start=1):
                if not text.strip():
                    continue
                where = f"{path.name}:{number}"
                try:
                    yield where, json.loads(text, parse_constant=_no_constant)
                except ValueError as exc:
                    raise ConfigError(f"{where}: not a JSON object on one line ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row as a dict)`` for each row, counted from 0; ``ConfigError`` for a file pyarrow cannot read."""
    try:
        import pyarrow.parquet as parquet
    except ImportError as exc:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow, which is not installed "
                          "(pip install pyarrow, or convert the file to JSON lines)") from exc
    try:
        table = parquet.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise ConfigError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from exc
    number = 0
    for batch in table.to_batches():
        for row in batch.to_pylist():
            yield f"{path.name} row {number}", row
            number += 1


def _prompt_line(where: str, row: Any, options: PromptFileOptions, tokenizer: _Tokenizer | None) -> PromptLine:
    if not isinstance(row, dict):
        raise ValueError(f"a line must be a JSON object (got {type(row).__name__})")
    content = _prompt(row, options, tokenizer)
    content["label"] = row.get(options.label_key)
    content["n_samples"] = _given(row, "n_samples", options.n_samples)
    content["adapter"] = _given(row, "adapter", options.adapter)
    content["metadata"] = _given(row, "metadata", {})
    content["sampling"] = _sampling(row.get("sampling"))
    given_id = row.get("id")
    PromptGroup(id="-" if given_id is None else given_id, group_index=0, **content)  # ContractError naming a field
    canonical = _canonical(content)  # and JSON can hold all of it (no NaN in metadata, no bytes)
    return PromptLine(id=prompt_id(canonical) if given_id is None else given_id, where=where, content=content)


def _given(row: dict[str, Any], name: str, default: Any) -> Any:
    value = row.get(name)
    return default if value is None else value


def _sampling(value: Any) -> dict[str, Any]:
    """The line's sampling parameters; a Parquet struct's null members are parameters not given."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"'sampling' must be an object of {sorted(SAMPLING_KEYS)} (got {value!r})")
    return {name: number for name, number in value.items() if number is not None}


def _canonical(content: dict[str, Any]) -> dict[str, Any]:
    """The content a line without an id is known by: its JSON form, so a Parquet row and the same JSON line
    (or a tuple and a list) hash alike. Not JSON: refused by name before the hash."""
    try:
        return json.loads(json.dumps(content, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a value JSON cannot hold: {exc}") from exc


def _prompt(row: dict[str, Any], options: PromptFileOptions, tokenizer: _Tokenizer | None) -> dict[str, Any]:
    """``input_ids``, ``text`` and ``tokenizer`` of the line's prompt."""
    key = options.prompt_key
    prompt = row.get(key) if key != INPUT_IDS_KEY else None
    input_ids = row.get(INPUT_IDS_KEY)
    if prompt is not None and input_ids is not None:
        raise ValueError(f"give either {key!r} (text or chat messages) or {INPUT_IDS_KEY!r} (token ids), not both")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError(f"{INPUT_IDS_KEY!r} must be a non-empty list of token ids (got {str(input_ids)[:80]})")
        return {"input_ids": input_ids, "text": None, "tokenizer": None}
    if prompt is None:
        raise ValueError(f"no prompt: the line has no {key!r} (text or chat messages; --prompt-key names "
                         f"another field) and no {INPUT_IDS_KEY!r}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{key!r} is an empty string")
        tokens = _need(tokenizer, key, "text")
        return _tokenized(prompt, tokens.text_ids(prompt), tokens.name, key)
    if isinstance(prompt, list):
        _check_messages(prompt, key)
        tokens = _need(tokenizer, key, "chat messages")
        rendered = tokens.render(prompt)
        return _tokenized(rendered, tokens.rendered_ids(rendered), tokens.name, key)
    raise ValueError(f"{key!r} must be text or a list of chat messages (got {type(prompt).__name__}: "
                     f"{str(prompt)[:80]})")


def _need(tokenizer: _Tokenizer | None, key: str, what: str) -> _Tokenizer:
    if tokenizer is None:
        raise ValueError(f"{key!r} is {what}: give --tokenizer DIR (a local Hugging Face tokenizer) to turn it "
                         f"into token ids, or give {INPUT_IDS_KEY!r}")
    return tokenizer


def _tokenized(text: str, input_ids: list[int], tokenizer: str, key: str) -> dict[str, Any]:
    if not input_ids:
        raise ValueError(f"{key!r} tokenizes to no tokens with {tokenizer!r}")
    return {"input_ids": input_ids, "text": text, "tokenizer": tokenizer}


def _check_messages(messages: list[Any], key: str) -> None:
    if not messages:
        raise ValueError(f"{key!r} is an empty list of chat messages")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{key!r} message {number} must be an object with a string 'role' and a 'content' "
                             f"(got {str(message)[:80]})")
        if "content" not in message:
            raise ValueError(f"{key!r} message {number} (role {message['role']!r}) has no 'content'")
