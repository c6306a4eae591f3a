"""Benchmark: bytes of the CSR sampling mask vs a padded [T, 64] int32 layout of the same supports.

Supports hold 1-64 ids (mean ~8, a geometric-like spread as top-p gives), T = 4096 tokens.
Prints both sizes and padded / CSR. Run: .venv/bin/python bench/memory.py
"""

from __future__ import annotations

import numpy as np

from rollout_bus.model.sampling_mask import RolloutSamplingMask

TOKENS = 4096
TOP_K = 64


def main() -> None:
    rng = np.random.default_rng(0)
    sizes = np.clip(rng.geometric(1 / 8, size=TOKENS), 1, TOP_K)
    ids = rng.integers(0, 150_000, size=int(sizes.sum()), dtype=np.int32)
    mask = RolloutSamplingMask(ids, np.concatenate([[0], np.cumsum(sizes)]))
    padded_bytes = TOKENS * TOP_K * np.dtype(np.int32).itemsize
    print(f"supports: T={TOKENS}, size min={sizes.min()} mean={sizes.mean():.2f} max={sizes.max()}")
    print(f"CSR (ids int32 + offsets int64): {mask.nbytes} bytes")
    print(f"padded [T, {TOP_K}] int32: {padded_bytes} bytes")
    print(f"padded / CSR = {padded_bytes / mask.nbytes:.2f}x  (CSR stores only real ids plus 8 bytes per token)")


if __name__ == "__main__":
    main()
