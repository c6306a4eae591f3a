"""Benchmark: the elastic generator group on rollout.prompts: takeover time, the prompt path's cost, memory.

Three figures, each measured in this one run on fresh, prefixed topics (needs a broker: the local one is
started when ``--bootstrap-servers`` is not given):

1. **Takeover**: three members (``generate --from-prompts --turn-latency-ms 200 --concurrency 2``) work through
   a large prompt set; ``--kills`` times (default 20) one member holding a prompt group in flight (at its first
   delivery: one killed three times is failed, by design, after ``--max-deliveries``) is killed -9
   and a replacement started; the time from the kill to that prompt group's next ``claimed`` event (another
   member has it in progress) is read off rollout.prompt_ledger. Prints p50/p99/max.
2. **Cost per prompt group**: the same episodes made by the seeded generator alone (``generate --episodes E``) and
   by one member from loaded prompts (``prompts load`` + ``generate --from-prompts``), each a fresh process; CPU
   seconds (user + system, ``os.wait4``) per prompt group of each, and their ratio.
3. **Memory**: a member's peak RSS making P and 10 P prompt groups (the same settings), and their ratio.

``.venv/bin/python bench/prompt_group.py [--bootstrap-servers HOST:PORT] [--kills 20] [--groups 32]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.prompt_ledger import LedgerLog
from rollout_bus.local_kafka.local_broker import LocalBroker
from rollout_bus.wire.topics import Topics

SHAPE = ["--max-turns", "2", "--min-response-len", "8", "--max-response-len", "32", "--vocab-size", "4096",
         "--seed", "3"]
SAMPLES = 4


def prompt_file(path: Path, groups: int) -> Path:
    with path.open("w") as out:
        for i in range(groups):
            out.write(json.dumps({"id": f"b-{i}", "input_ids": [5 + (i * 7 + j) % 4000 for j in range(16)],
                                  "label": str(i)}) + "\n")
    return path


def load(bootstrap: str, topics: Topics, path: Path) -> None:
    subprocess.run([sys.executable, "-m", "rollout_bus.cli.main", "prompts", "load", str(path), "--bootstrap-servers",
                    bootstrap, "--topic-prefix", topics.prefix, "--n-samples", str(SAMPLES)], check=True,
                   stdout=subprocess.DEVNULL)


def member(bootstrap: str, topics: Topics, name: str, log_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rollout_bus.cli.generate", "--from-prompts", "--bootstrap-servers", bootstrap,
           "--topic-prefix", topics.prefix, "--member-id", name, *SHAPE, *extra]
    return subprocess.Popen(cmd, stdout=open(log_dir / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


def cpu_and_rss(proc: subprocess.Popen) -> tuple[float, float]:
    """Wait for ``proc``; (its CPU seconds, its peak RSS in MiB)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{proc.args[:6]} exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def broker_for(bootstrap: str) -> tuple[str, LocalBroker | None]:
    """``bootstrap`` when given; else the local broker started on a port of its own (stop it after)."""
    if bootstrap:
        return bootstrap, None
    broker = LocalBroker(port=39192, data_dir=Path(tempfile.mkdtemp(prefix="rb-bench-broker-")))
    return broker.start().bootstrap, broker


def fresh(bootstrap: str) -> Topics:
    topics = Topics(prefix=f"bpg{uuid.uuid4().hex[:8]}.")
    ensure_topics({"bootstrap_servers": bootstrap}, topics)
    return topics


def takeover(bootstrap: str, kills: int, log_dir: Path) -> list[float]:
    topics = fresh(bootstrap)
    load(bootstrap, topics, prompt_file(log_dir / "takeover.jsonl", 40 * kills))
    paced = ("--turn-latency-ms", "200", "--concurrency", "2")
    members = {f"t{i}": member(bootstrap, topics, f"t{i}", log_dir, *paced) for i in range(3)}
    log, times, n = LedgerLog({"bootstrap_servers": bootstrap}, topics), [], 3
    try:
        while len(times) < kills:
            ledger = log.catch_up()
            held = {p: g for p, g in ledger.claimant.items()  # a first delivery: a third kill would fail it
                    if p not in ledger.ended and g in members and ledger.deliveries[p] == 1}
            if not held:
                time.sleep(0.1)
                continue
            prompt, victim = next(iter(held.items()))
            delivery = ledger.deliveries[prompt]
            members.pop(victim).send_signal(signal.SIGKILL)
            killed = time.monotonic()
            name = f"t{n}"
            n += 1
            members[name] = member(bootstrap, topics, name, log_dir, *paced)
            while log.catch_up().deliveries.get(prompt, 0) <= delivery:
                if time.monotonic() - killed > 120:
                    raise SystemExit(f"prompt group {prompt} not taken over in 120 s")
                time.sleep(0.05)
            times.append(time.monotonic() - killed)
            print(f"kill {len(times)}/{kills}: {victim} held {prompt}; taken over after {times[-1]:.2f}s",
                  file=sys.stderr)
    finally:
        for proc in members.values():
            proc.kill()
        log.close()
    return times


def seeded_cpu(bootstrap: str, groups: int, log_dir: Path) -> float:
    topics = fresh(bootstrap)
    proc = subprocess.Popen([sys.executable, "-m", "rollout_bus.cli.generate", "--bootstrap-servers", bootstrap,
                             "--topic-prefix", topics.prefix, "--episodes", str(groups * SAMPLES),
                             "--n-samples-per-prompt", str(SAMPLES), *SHAPE],
                            stdout=open(log_dir / "seeded.log", "wb"), stderr=subprocess.STDOUT)
    return cpu_and_rss(proc)[0]


def prompted(bootstrap: str, groups: int, log_dir: Path) -> tuple[float, float]:
    topics = fresh(bootstrap)
    load(bootstrap, topics, prompt_file(log_dir / f"p{groups}.jsonl", groups))
    return cpu_and_rss(member(bootstrap, topics, f"p{groups}", log_dir, "--concurrency", "4"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default="")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--groups", type=int, default=32)
    args = parser.parse_args()
    bootstrap, broker = broker_for(args.bootstrap_servers)
    log_dir = Path(tempfile.mkdtemp(prefix="rb-bench-prompts-"))
    try:
        times = sorted(takeover(bootstrap, args.kills, log_dir))
        p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        print(f"takeover after kill -9 ({len(times)} kills, session timeout 6 s): p50 {statistics.median(times):.2f}s "
              f"p99 {p99:.2f}s max {times[-1]:.2f}s")
        seeded = seeded_cpu(bootstrap, args.groups, log_dir)
        cpu_1x, rss_1x = prompted(bootstrap, args.groups, log_dir)
        print(f"cpu per prompt group ({args.groups} groups x {SAMPLES} episodes): seeded generator "
              f"{1000 * seeded / args.groups:.1f} ms, member from prompts {1000 * cpu_1x / args.groups:.1f} ms, "
              f"ratio {cpu_1x / seeded:.2f} (each a fresh process, start-up included)")
        cpu_10x, rss_10x = prompted(bootstrap, 10 * args.groups, log_dir)
        print(f"member peak RSS: {args.groups} groups {rss_1x:.0f} MiB, {10 * args.groups} groups {rss_10x:.0f} "
              f"MiB, ratio {rss_10x / rss_1x:.2f}")
    finally:
        if broker is not None:
            broker.stop()
    print(f"logs in {log_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
