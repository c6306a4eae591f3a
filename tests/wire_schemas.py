"""The JSON Schemas of WIRE.md (``schemas/*.json``), loaded once, and one call to check a document against one.

Tests validate what the code emits with ``validate("manifest", doc)``; a failure is an AssertionError
naming the schema and the JSON path of every violation, so a drift between code and spec reads as such.
Schemas refer to each other by relative ``$ref`` (``manifest.json``), resolved against their ``$id``s.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"
ID_BASE = "https://rollout-bus.dev/schemas/"


@lru_cache(maxsize=1)
def schemas() -> dict[str, dict[str, Any]]:
    """Every schema by name (file stem)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(SCHEMA_DIR.glob("*.json"))}


@lru_cache(maxsize=1)
def _registry() -> Registry:
    resources = [(schema["$id"], Resource.from_contents(schema)) for schema in schemas().values()]
    return Registry().with_resources(resources)


@lru_cache(maxsize=None)
def validator(schema_name: str) -> Draft202012Validator:
    """A validator for one schema, with format checking and the other schemas resolvable by ``$ref``."""
    found = schemas()
    if schema_name not in found:
        raise KeyError(f"no schema {schema_name!r} in {SCHEMA_DIR} (have {sorted(found)})")
    return Draft202012Validator(found[schema_name], registry=_registry(),
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


def problems(schema_name: str, document: Any) -> list[str]:
    """Every violation as ``$.json.path: message``, deepest first; empty when the document is valid."""
    errors = sorted(validator(schema_name).iter_errors(document), key=lambda e: (-len(e.absolute_path), e.message))
    return [f"{e.json_path}: {e.message[:300]}" for e in errors]


def validate(schema_name: str, document: Any) -> None:
    """AssertionError naming the schema and each failing path unless ``document`` is valid."""
    found = problems(schema_name, document)
    if found:
        listed = "\n  ".join(found[:12]) + (f"\n  ... {len(found) - 12} more" if len(found) > 12 else "")
        raise AssertionError(f"document does not match schema {schema_name!r} ({SCHEMA_DIR / schema_name}.json):"
                             f"\n  {listed}")


def header_object(headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """Kafka headers as the object the header schemas describe (UTF-8 text; the last of a repeated name wins,
    as the decoders read them)."""
    return {name: bytes(value or b"").decode("utf-8", "replace") for name, value in (headers or [])}
