"""Benchmark: log-probs restricted to the sampling support, CSR (``support_log_probs``) vs a dense mask.

One shard's worth of response tokens (4,096 by default) with random supports of 1-15 distinct ids
(mean 8, about 1 in 15 a singleton, as a forced token has) over a 32k vocabulary, float32 logits on
the CPU. In one run, alternating which goes first, we time ``support_log_probs`` (gathers the N
support logits and reduces them per row) and ``dense_support_log_probs`` (a dense ``[R, V]`` mask,
``-inf`` outside, ``log_softmax``, gather: the slow reference). Both include the same input checks.
Prints one row per method (median and min of ``--reps`` timings after a warm-up), the ratio of the
medians dense/restricted, and the largest absolute difference between the two results. The
restricted path is ~30 small ops, each a parallel region above torch's grain size: when another
process holds a core, every region waits for a descheduled thread and its time grows by tens of
times, while ``--threads 1`` is unaffected; compare figures taken at a load average below 1.
Run: ``.venv/bin/python bench/trainer_math.py [--tokens 4096] [--vocab 32768] [--reps 5] [--threads 2]
[--backward]`` (``--backward`` times forward + backward instead of the forward pass alone).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from rollout_bus.model.trainer_math import dense_support_log_probs, support_log_probs

METHODS = {"restricted": support_log_probs, "dense": dense_support_log_probs}


def make_shard(tokens: int, vocab: int, max_support: int, seed: int):
    """Logits [tokens, vocab] and a CSR of distinct-id supports of 1..max_support ids; targets in them."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_support + 1, size=tokens)
    supports = [rng.choice(vocab, int(s), replace=False) for s in sizes]
    ids = torch.from_numpy(np.concatenate(supports).astype(np.int32))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    targets = torch.tensor([int(s[rng.integers(0, len(s))]) for s in supports], dtype=torch.int64)
    logits = torch.from_numpy(rng.standard_normal((tokens, vocab), dtype=np.float32) * 3)
    return logits, targets, ids, offsets, sizes


def _timed(fn, logits: torch.Tensor, args: tuple, backward: bool) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    if backward:
        leaf = logits.detach().requires_grad_(True)
        out = fn(leaf, *args)
        out.sum().backward()
    else:
        with torch.no_grad():
            out = fn(logits, *args)
    return (time.perf_counter() - start) * 1000, out.detach()


def run(tokens: int, vocab: int, max_support: int, reps: int, backward: bool, seed: int) -> None:
    logits, targets, ids, offsets, sizes = make_shard(tokens, vocab, max_support, seed)
    args = (targets, ids, offsets)
    results = {}
    for name, fn in METHODS.items():  # warm-up: code paths and the allocator
        _, results[name] = _timed(fn, logits, args, backward)
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    order = list(METHODS)
    for k in range(reps):
        for name in order if k % 2 == 0 else order[::-1]:  # alternate, so neither always runs second
            ms, results[name] = _timed(METHODS[name], logits, args, backward)
            times[name].append(ms)
    what = "forward+backward" if backward else "forward"
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:<11} {tokens} tokens  V={vocab}  mean support {sizes.mean():.1f}: median {median:.1f} ms"
              f"  (min {min(times[name]):.1f}; {what}, {reps} reps, {torch.get_num_threads()} threads)")
    print(f"ratio dense/restricted: {medians['dense'] / medians['restricted']:.1f}x")
    diff = (results["restricted"] - results["dense"]).abs().max().item()
    singletons = int((sizes == 1).sum())
    print(f"max abs difference: {diff:.2e}  ({singletons} singleton rows, all exactly 0.0: "
          f"{bool((results['restricted'][torch.from_numpy(sizes == 1)] == 0).all())})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--max-support", type=int, default=15, help="supports hold 1..max-support ids")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (this machine has 2 cores)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run(args.tokens, args.vocab, args.max_support, args.reps, args.backward, args.seed)


if __name__ == "__main__":
    main()
