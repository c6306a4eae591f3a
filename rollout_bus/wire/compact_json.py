"""The bus's one JSON spelling: no spaces, keys sorted, ASCII escapes, so the same value gives the same bytes.

Every JSON value rollout-bus writes on a topic or into its state (control records, metrics, announcements,
the rollout key, weight versions, the run's batching) is spelled by ``compact_json`` (WIRE.md section 1).
Two writers that agree on the value agree on the bytes: a replay compares byte for byte, and a compacted
key keeps one spelling. The samples document has its own fast writer with the same separators
(``samples_json``); ``model.episode_stats`` spells its text the same way below the wire.
"""

from __future__ import annotations

import json
from typing import Any


def compact_json(value: Any, *, allow_nan: bool = True) -> bytes:
    """``value`` as compact, key-sorted JSON bytes; ``allow_nan=False`` refuses NaN and infinities."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=allow_nan).encode()
