"""Benchmark: growing a sampling mask turn by turn with SamplingMaskBuilder vs re-concatenating.

Prints (1) the time to build a 64k-token mask over 1,000 turns with the builder and by
``RolloutSamplingMask.concatenate`` after every turn, and their ratio (concatenation is O(T^2));
(2) builder time for 4x the turns over 1x (linear scaling gives ~4).
Run: .venv/bin/python bench/mask_builder.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from rollout_bus.model.sampling_mask import RolloutSamplingMask, SamplingMaskBuilder

TOKENS_PER_TURN = 64
TURNS = 1_000
REPEATS = 11


def make_turns(n_turns: int, seed: int = 0) -> list[RolloutSamplingMask]:
    """Per-turn masks with supports of 1-16 ids (mean ~8), as an engine would return them."""
    rng = np.random.default_rng(seed)
    turns = []
    for _ in range(n_turns):
        sizes = rng.integers(1, 17, size=TOKENS_PER_TURN)
        ids = rng.integers(0, 150_000, size=int(sizes.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        turns.append(RolloutSamplingMask(ids, offsets))
    return turns


def with_builder(turns: list[RolloutSamplingMask]) -> RolloutSamplingMask:
    builder = SamplingMaskBuilder()
    for mask in turns:
        builder.extend(mask)
    return builder.build()


def with_concatenate(turns: list[RolloutSamplingMask]) -> RolloutSamplingMask:
    acc = RolloutSamplingMask.concatenate([])
    for mask in turns:
        acc = RolloutSamplingMask.concatenate([acc, mask])
    return acc


def median_seconds(fn, arg, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    turns = make_turns(TURNS)
    many = make_turns(4 * TURNS, seed=1)
    if with_builder(turns) != with_concatenate(turns):
        raise SystemExit("builder and concatenate disagree")
    t_builder = median_seconds(with_builder, turns)
    t_concat = median_seconds(with_concatenate, turns, repeats=3)
    t_builder_4x = median_seconds(with_builder, many)
    tokens = TURNS * TOKENS_PER_TURN
    print(f"builder, {tokens} tokens over {TURNS} turns: {t_builder * 1e3:.2f} ms (median of {REPEATS})")
    print(f"concatenate after every turn, same data: {t_concat * 1e3:.2f} ms (median of 3)")
    print(f"concatenate / builder = {t_concat / t_builder:.1f}x  (re-concatenating copies the whole mask each turn: O(T^2))")
    print(f"builder, {4 * TURNS} turns: {t_builder_4x * 1e3:.2f} ms; 4x turns / 1x = {t_builder_4x / t_builder:.2f}"
          "  (linear scaling gives ~4)")


if __name__ == "__main__":
    main()
