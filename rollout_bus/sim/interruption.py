"""Where the simulated generator cuts a turn interrupted by new weights (the cut itself: ``model.turns.split_turn``).

When new weights go live mid-turn, engines abort the request and return the tokens generated so
far (SkyRL, NeMo-RL partial rollouts); the next request continues the same response under the new
weights. On the bus that is two turn records of one attempt: the partial one (status ABORTED, not
final) and its continuation, whose tokens are the partial turn's followed directly by the rest of
the response. The stream stage's merge (``rollout_bus.model.turns``) folds them back into one response.

Contract: ``interruption_point(sample, rng)`` picks a seeded split before a generated token other
than the first (never inside tool output), or None; ``rollout_bus.model.turns.split_turn`` cuts there.
"""

from __future__ import annotations

import numpy as np

from rollout_bus.model.sample import Sample


def interruption_point(sample: Sample, rng: np.random.Generator) -> int | None:
    """A split before a generated response token other than the first, or None when there is none."""
    mask = np.asarray(sample.loss_mask if sample.loss_mask is not None else np.ones(sample.response_length), np.int64)
    candidates = np.flatnonzero(mask[1:] == 1) + 1
    return int(rng.choice(candidates)) if candidates.size else None
