"""Benchmark: what resuming taken-over prompt groups from the log saves, side by side with making them again.

One workload run twice in this one invocation, each on fresh, prefixed topics (needs a broker: the local one is
started when ``--bootstrap-servers`` is not given): ``--groups`` prompt groups of multi-turn episodes
(``--max-turns``, the sim engine at ``--turn-latency-ms`` per engine call), three members of the generator group
(``generate --from-prompts --concurrency 2``); every ``--every`` seconds (default 20) one member holding a prompt
group in flight is killed -9 and a replacement started, until the run ends. Run (a) with ``--no-resume`` (a
taken-over group is made again from its first token, as before resuming), run (b) as shipped (resumed from the
log). Then rollout.turns is read back: every turn record's response tokens, and those of the distinct turns
(rollout key, attempt, turn): the rest were **made again** (the seeded engine makes a turn the same whoever makes
it, so a turn made twice is the same turn). Prints per run: kills, turns and response tokens sent, tokens made
again (in all, and per kill), the wall time to the run's end; then (b)'s tokens made again as a fraction of
(a)'s. A run that makes its groups again from scratch lasts longer, so it is killed more often: that is part
of what it costs.

``.venv/bin/python bench/resume.py [--bootstrap-servers HOST:PORT] [--groups 240] [--every 20]``
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollout_bus.kafka.prompt_ledger import LedgerLog
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.wire.codec import decode_samples
from rollout_bus.wire.episode_record import TURN_FIELDS
from rollout_bus.wire.headers import TurnHeaders, control_kind
from rollout_bus.wire.topics import Topics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prompt_group import broker_for, fresh, load, member, prompt_file  # noqa: E402


def run(bootstrap: str, args: argparse.Namespace, resume: bool, log_dir: Path) -> dict:
    """One run of the workload, killed as the module docstring says; its figures."""
    topics = fresh(bootstrap)
    label = "resume" if resume else "no-resume"
    load(bootstrap, topics, prompt_file(log_dir / f"{label}.jsonl", args.groups))
    extra = ("--max-turns", str(args.max_turns), "--turn-latency-ms", str(args.turn_latency_ms), "--concurrency", "2",
             "--max-deliveries", "100", "--resume" if resume else "--no-resume")
    members = {f"{label}-{i}": member(bootstrap, topics, f"{label}-{i}", log_dir, *extra) for i in range(3)}
    log, n, kills = LedgerLog({"bootstrap_servers": bootstrap}, topics), 3, 0
    began = next_kill = time.monotonic()
    next_kill += args.every
    try:
        while not log.catch_up().all_ended():
            if time.monotonic() - began > args.timeout:
                raise SystemExit(f"{label}: the run did not end in {args.timeout:.0f} s (logs in {log_dir})")
            if time.monotonic() >= next_kill:
                ledger = log.ledger
                holders = sorted({g for p, g in ledger.claimant.items() if p not in ledger.ended and g in members})
                if holders:
                    members.pop(holders[0]).send_signal(signal.SIGKILL)
                    kills += 1
                    name = f"{label}-{n}"
                    n += 1
                    members[name] = member(bootstrap, topics, name, log_dir, *extra)
                    next_kill += args.every
                    print(f"{label}: kill {kills}: {holders[0]} (-9), {name} started", file=sys.stderr)
            time.sleep(0.2)
        wall = time.monotonic() - began
        for proc in members.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        for proc in members.values():
            proc.kill()
        log.close()
    return {"label": label, "kills": kills, "wall_s": wall, **turn_tokens(bootstrap, topics)}


def turn_tokens(bootstrap: str, topics: Topics) -> dict:
    """Turns and response tokens on rollout.turns, all and distinct (rollout key, attempt, turn)."""
    reader = TopicReader({"bootstrap_servers": bootstrap}, [topics.turns])
    try:
        records = reader.read_to_end().get(topics.turns, [])
    finally:
        reader.close()
    sent = tokens = 0
    distinct: dict[tuple[bytes, int, int], int] = {}
    for record in records:
        if control_kind(record.headers) is not None:
            continue
        headers = TurnHeaders.from_kafka(record.headers)
        [sample], _ = decode_samples(record.value, TURN_FIELDS)
        sent += 1
        tokens += sample.response_length
        distinct[(record.key, headers.attempt, headers.turn)] = sample.response_length
    once = sum(distinct.values())
    return {"turns": sent, "tokens": tokens, "distinct_turns": len(distinct), "made_again": tokens - once}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default="")
    parser.add_argument("--groups", type=int, default=240)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--turn-latency-ms", type=float, default=400)
    parser.add_argument("--every", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    bootstrap, broker = broker_for(args.bootstrap_servers)
    log_dir = Path(tempfile.mkdtemp(prefix="rb-bench-resume-"))
    try:
        rows = [run(bootstrap, args, resume, log_dir) for resume in (False, True)]
    finally:
        if broker is not None:
            broker.stop()
    print(f"workload: {args.groups} prompt groups x 4 episodes, --max-turns {args.max_turns}, "
          f"--turn-latency-ms {args.turn_latency_ms:g}, 3 members, one killed -9 every {args.every:g} s")
    for row in rows:
        print(f"{row['label']:>9}: {row['kills']} kills, {row['turns']} turns sent ({row['distinct_turns']} distinct), "
              f"{row['tokens']} response tokens sent, {row['made_again']} made again "
              f"({row['made_again'] / max(1, row['kills']):.0f} per kill), run {row['wall_s']:.1f} s")
    a, b = rows
    print(f"tokens made again, resume vs no-resume: {b['made_again']} / {a['made_again']} = "
          f"{b['made_again'] / max(1, a['made_again']):.3f}; wall time ratio {b['wall_s'] / a['wall_s']:.2f}")
    print(f"logs in {log_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
