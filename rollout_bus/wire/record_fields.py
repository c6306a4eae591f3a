"""Reading back a small JSON record value: one object whose fields have the types the record names.

Why: the control records (``control_records``) and the weight version (``weight_version``) are such
objects, and refuse a malformed value the same way, naming the record and the field.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from rollout_bus.errors import ContractError, must_be


def record_fields(value: bytes | None, what: str, fields: dict[str, type],
                  nullable: Collection[str] = ()) -> dict[str, Any]:
    """``value`` parsed as a JSON object holding ``fields`` of their types (``nullable`` ones may be null or
    absent; an int is never a bool); ContractError naming ``what`` and the field otherwise."""
    try:
        doc = json.loads(value) if value is not None else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ContractError(must_be(f"{what} record value", f"a JSON object with {sorted(fields)}",
                                    value[:200] if value else value))
    for name, kind in fields.items():
        found = doc.get(name)
        if found is None and name in nullable:
            continue
        if not isinstance(found, kind) or (kind is int and isinstance(found, bool)):
            raise ContractError(must_be(f"{what} field {name!r}", kind.__name__, found))
    return doc
