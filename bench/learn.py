"""The policy learning through the bus, under staleness bounds side by side: one `demo --learn` per bound.

Each run is the whole loop on the local broker (generator with the real policy, stream worker, shard
writer, `rollout-bus train`), the same seed and sampling (top-p 0.9, top-k 20), fresh topics. Per bound it
prints: the mean reward of the first and last 5 batches, when the trailing 5-batch reward first reached
0.8 (batch, seconds since the first step), the run's wall time; the train/inference mismatch (the
trainer's support log-prob at the token's own version minus the rollout log-prob: max over every token;
and the full-vocabulary log-prob's gap: the mean of the steps' means, the largest step p99); and the importance
ratios exp(new - old) (the mean of the steps' means, the largest step p99 and max, the mean clip fraction). Progress on stderr,
figures on stdout.

    .venv/bin/python bench/learn.py [--staleness 0,1,2] [--episodes 5120] [--bootstrap-servers HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rollout_bus.consumers.feed.training import read_trained
from rollout_bus.local_kafka.local_broker import BrokerLease


def log(message: str) -> None:
    print(f"[learn-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", default="0,1,2", help="Comma-separated bounds, one run each.")
    parser.add_argument("--episodes", type=int, default=80 * 64, help="Episodes per run (64 per batch).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap-servers", default=None, help="Default: the local broker, started if needed.")
    parser.add_argument("--out", type=Path, default=Path(f"/tmp/rollout-bus-bench-learn-{uuid.uuid4().hex[:6]}"))
    return parser.parse_args()


def run_one(bootstrap: str, bound: int, args: argparse.Namespace) -> dict:
    out = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}-staleness-{bound}"
    cmd = [sys.executable, "-m", "rollout_bus.cli.main", "demo", "--learn", "--max-staleness", str(bound),
           "--episodes", str(args.episodes), "--seed", str(args.seed), "--bootstrap-servers", bootstrap,
           "--out", str(out), "--timeout", "1200"]
    began = time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "COLUMNS": "160"})
    wall = time.monotonic() - began
    if done.returncode != 0:
        log(f"staleness {bound}: demo exited {done.returncode}; last lines:\n{done.stderr[-3000:]}")
    doc = json.loads((out / "learn.json").read_text())
    return {"bound": bound, "code": done.returncode, "wall": wall, "doc": doc, "rows": read_trained(out / "train")}


def main() -> int:
    args = parse_args()
    bounds = [int(b) for b in args.staleness.split(",") if b.strip()]
    results = []
    with BrokerLease(args.bootstrap_servers, echo=log) as bootstrap:
        for bound in bounds:
            log(f"demo --learn --max-staleness {bound}, {args.episodes} episodes ...")
            results.append(run_one(bootstrap, bound, args))
            log(f"staleness {bound}: done in {results[-1]['wall']:.1f}s")
    print(f"demo --learn, seed {args.seed}, {args.episodes} episodes (64 per batch), top-p 0.9, top-k 20")
    print(f"{'bound':>5} {'exit':>4} {'reward first5':>13} {'last5':>6} {'reached 0.8 at':>15} {'wall s':>7} "
          f"{'mismatch max':>12} {'full-vocab gap mean/p99':>23} {'ratio mean/p99/max':>20} {'clip':>6} "
          f"{'staleness max':>13}")
    for r in results:
        v, rows = r["doc"]["verdict"], r["rows"]
        reached = (f"b{v['reached_at_seq']} {v['reached_after_s']:.1f}s" if v["reached_at_seq"] is not None
                   else "never")
        gap_mean = sum(x["full_vocab_mismatch_mean"] for x in rows) / len(rows)
        gap_p99 = max(x["full_vocab_mismatch_p99"] for x in rows)
        ratio_mean = sum(x["ratio_mean"] for x in rows) / len(rows)
        ratio_p99 = max(x["ratio_p99"] for x in rows)
        ratio_max = max(x["ratio_max"] for x in rows)
        clip = sum(x["clip_fraction"] for x in rows) / len(rows)
        first = "n/a" if v["first_reward"] is None else f"{v['first_reward']:.3f}"
        last = "n/a" if v["last_reward"] is None else f"{v['last_reward']:.3f}"
        print(f"{r['bound']:>5} {r['code']:>4} {first:>13} {last:>6} {reached:>15} {r['wall']:>7.1f} "
              f"{max(x['mismatch_max'] for x in rows):>12.2e} {f'{gap_mean:.4f}/{gap_p99:.4f}':>23} "
              f"{f'{ratio_mean:.4f}/{ratio_p99:.3f}/{ratio_max:.3f}':>20} {clip:>6.4f} "
              f"{max(x['staleness_max'] for x in rows):>13.0f}")
    return 0 if all(r["code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
