"""Pipeline throughput against the raw bus, measured side by side in one run on the local broker.

The same encoded turn records (the generator's workload, scaled by --episodes) are
(1) produced with kafka-python and consumed back with no processing: the raw-bus ceiling (run just
before and just after the pipeline; the better run counts); and
(2) produced into the full pipeline (stream worker(s) + shard writer processes, started and warm):
turns in, shards out; done once every final turn's episode is in a batch announced on rollout.shards.
Reports CPU per turn and per MB of payload of each stage (user + system from /proc, over the run, its idle rate
subtracted) beside a plain consumer's (a process of its own reading the same records) and the built-in
generator's (its engine only). Reports turns/s of both and their ratio, response tokens/s, p50/p99 latency (under that full-speed
load) from a final turn's send to its episode record and to its batch's announcement on rollout.shards
(broker LogAppendTime), and the peak memory (VmHWM) of each stage process. Every pipeline run is
fresh (new topics, groups, out dir); progress goes to stderr, figures to stdout.

Modes (combine freely; each adds its rows after the default ones):

    .venv/bin/python bench/pipeline.py [--episodes 512] [--bootstrap-servers 127.0.0.1:39092]
    .venv/bin/python bench/pipeline.py --workload long [--episodes 256]
        responses of 1,000-4,000 tokens per turn (sampling masks on): pipeline/raw ratio and response
        tokens/s per stream worker; 8 distinct episodes generated, copied under new ids (--distinct)
    .venv/bin/python bench/pipeline.py --latency
        then a fresh pipeline fed at 50% of the throughput just measured (--pace, each record at its
        scheduled time): final turn -> episode record and -> batch announcement, p50/p99
    .venv/bin/python bench/pipeline.py [--stream-workers 2] [--compare-workers [1,2,3]]
        N stream workers sharing one Faust group; --compare-workers: a fresh run with each worker count
        (default 1 and 2) on the same records, turns/s of each, per worker, and N/1 (the default run
        lasts ~2 s and its ratio swings with the load; --episodes 2048 --distinct 512 gives runs of
        several seconds)
    .venv/bin/python bench/pipeline.py --latency --paced-runs 5
        five paced runs, each fresh, each with its own latency rows
    .venv/bin/python bench/pipeline.py --secure [--secure-port 39392]
        then the same raw bus and pipeline on a secured local broker (SASL_SSL with SCRAM-SHA-512, ACLs;
        each stage its role's principal, the bench's own clients its admin): turns/s of each and
        secured/plaintext for both
    .venv/bin/python bench/pipeline.py --memory
        also a fresh run at 4x --episodes (copies of the same episodes): peak RSS per stage at 1x and
        4x and 4x/1x (target <= 1.2)

--episodes is rounded up to whole batches (16 episodes): no end-of-run is sent, so a partial batch
would never be written. Stage logs stay under --out/<run>/logs.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_runs import WHOLE_BATCH, generate, log, pipeline_run, raw_bus  # noqa: E402

from rollout_bus.local_kafka.local_broker import BrokerLease  # noqa: E402

DEFAULT_EPISODES = {"default": 512, "long": 256}
DEFAULT_DISTINCT = {"default": None, "long": 8}  # None: every episode distinct


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def latency_rows(prefix: str, result: dict) -> None:
    for name in ("to_episode", "to_batch"):
        values = result[name]
        print(f"{prefix}latency final turn -> {name[3:]:<8}: p50 {percentile(values, 0.5):6.0f} ms  "
              f"p99 {percentile(values, 0.99):6.0f} ms  (n={len(values)})")


def cpu_rows(result: dict, raw_cpu: float, turns: int, payload: int, workload, args) -> None:
    """CPU per turn of each stage (user + system from /proc, over the run, each stage's idle CPU subtracted) beside
    the plain consumer's, and per MB of payload; the built-in generator's beside them (its engine only)."""
    episodes = args.episodes
    print(f"CPU per turn (user + system, over the run, idle subtracted; {turns} turns, {episodes} episode records, "
          f"{payload / 1e6:.1f} MB):")
    print(f"  plain consumer (kafka-python, no processing): {raw_cpu / turns * 1e6:7.0f} us/turn  "
          f"{raw_cpu / (payload / 1e6) * 1e3:7.1f} ms/MB  ({raw_cpu:.2f} CPU-s)")
    for name, cpu in result["cpu"].items():
        per_record = f", {cpu / episodes * 1e6:.0f} us per episode record" if name == "shards" else ""
        print(f"  {name:<13} {cpu / turns * 1e6:7.0f} us/turn  {cpu / (payload / 1e6) * 1e3:7.1f} ms/MB  "
              f"{cpu / raw_cpu if raw_cpu else float('nan'):5.1f}x the plain consumer  ({cpu:.2f} CPU-s, idle "
              f"{result['idle_cpu'][name] * 1e3:.0f} ms/s subtracted{per_record})")
    made = len(workload.turns)
    print(f"  built-in generator (its engine only, no Kafka): {workload.cpu_s / made * 1e6:7.0f} us/turn  "
          f"({workload.cpu_s:.2f} CPU-s for the {made} distinct turns)")


def memory_text(memory: dict) -> str:
    return ", ".join(f"{k} {v:.0f} MB" for k, v in memory.items())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(DEFAULT_EPISODES), default="default")
    parser.add_argument("--episodes", type=int, default=None, help="default: 512 (default workload), 256 (long)")
    parser.add_argument("--distinct", type=int, default=None,
                        help="episodes generated; copies of them under new ids make up --episodes "
                             "(default: all distinct for the default workload, 8 for long)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-workers", type=int, default=1)
    parser.add_argument("--compare-workers", nargs="?", const="1,2", default=None, metavar="N,N,...",
                        help="pipeline turns/s with each of these worker counts (default 1,2), each a fresh run")
    parser.add_argument("--latency", action="store_true", help="a paced run: latency at --pace of the throughput")
    parser.add_argument("--pace", type=float, default=0.5, help="--latency's rate, a share of pipeline turns/s")
    parser.add_argument("--paced-runs", type=int, default=1, help="--latency: this many paced runs, each fresh")
    parser.add_argument("--memory", action="store_true", help="peak RSS per stage at --episodes and at 4x")
    parser.add_argument("--secure", action="store_true", help="also raw bus and pipeline on a secured local broker")
    parser.add_argument("--secure-port", type=int, default=39392, help="--secure: the secured broker's port")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--keep-topics", action="store_true", help="do not delete each run's topics afterwards")
    parser.add_argument("--out", type=Path, default=Path(f"/tmp/rollout-bus-bench-{uuid.uuid4().hex[:6]}"))
    args = parser.parse_args()
    try:
        args.compare_workers = sorted({int(n) for n in args.compare_workers.split(",")}) if args.compare_workers else []
    except ValueError:
        parser.error(f"--compare-workers {args.compare_workers}: expected worker counts such as 1,2,3")
    if any(n < 1 for n in args.compare_workers) or args.paced_runs < 1:
        parser.error("--compare-workers counts and --paced-runs must be >= 1")
    if args.out.exists() and any(args.out.iterdir()):  # a shard writer resumes from what it finds there
        parser.error(f"--out {args.out} is not empty: a run there would re-announce the batches it holds")
    asked = args.episodes or DEFAULT_EPISODES[args.workload]
    distinct = args.distinct or DEFAULT_DISTINCT[args.workload]
    # whole batches, made of whole copies of whole groups (4 episodes)
    step = WHOLE_BATCH if distinct is None else math.lcm(WHOLE_BATCH, 4 * math.ceil(distinct / 4))
    args.episodes = step * math.ceil(asked / step)
    args.distinct = args.episodes if distinct is None else 4 * math.ceil(distinct / 4)
    if args.episodes != asked:
        log(f"--episodes {asked} rounded up to {args.episodes} (whole batches of {WHOLE_BATCH} episodes, "
            f"whole copies of {args.distinct})")
    return args


def main() -> int:
    args = parse_args()
    copies = args.episodes // args.distinct
    log(f"generating {args.distinct} distinct episodes ({args.workload} workload) ...")
    workload = generate(args.workload, args.distinct, args.seed)
    records, response_tokens = workload.records(copies)
    payload = sum(len(k) + len(v) for k, v, _ in records)
    log(f"{len(records)} turn records, {payload / 1e6:.1f} MB, {response_tokens} response tokens")
    kw = {"keep_topics": args.keep_topics}
    extra = {}
    with BrokerLease(args.bootstrap_servers, echo=log) as bootstrap:
        conn = {"bootstrap_servers": bootstrap}
        log("raw bus (before the pipeline) ...")
        raw_before, raw_cpu_before = raw_bus(conn, records)
        log(f"raw bus done in {raw_before:.2f}s; running the pipeline with {args.stream_workers} stream worker(s) ...")
        result = pipeline_run(conn, records, args.episodes, args.out / "pipeline", workers=args.stream_workers,
                              **kw)
        log("raw bus (after the pipeline) ...")
        raw_after, raw_cpu_after = raw_bus(conn, records)
        raw_s = min(raw_before, raw_after)  # the ceiling: the better of the runs either side of the pipeline
        raw_cpu = min(raw_cpu_before, raw_cpu_after)
        log(f"raw bus runs: {raw_before:.2f}s before, {raw_after:.2f}s after the pipeline")
        by_workers = {args.stream_workers: result}
        for workers in args.compare_workers:
            if workers not in by_workers:
                log(f"compare-workers: a fresh pipeline with {workers} stream worker(s) ...")
                by_workers[workers] = pipeline_run(conn, records, args.episodes,
                                                   args.out / f"workers-{workers}", workers=workers, **kw)
        if args.memory:
            log(f"memory: a fresh pipeline at 4x ({4 * args.episodes} episodes) ...")
            records_4x = workload.records(4 * copies)[0]
            extra["memory"] = pipeline_run(conn, records_4x, 4 * args.episodes, args.out / "memory-4x",
                                           workers=args.stream_workers, **kw)
        if args.latency:
            rate = args.pace * len(records) / result["elapsed"]
            extra["latency"] = []
            for k in range(args.paced_runs):
                log(f"latency: a fresh pipeline fed at {rate:.0f} turns/s (run {k + 1}/{args.paced_runs}) ...")
                extra["latency"].append(pipeline_run(conn, records, args.episodes, args.out / f"paced-{k + 1}",
                                                     workers=args.stream_workers, rate=rate, **kw))
    if args.secure:
        secure = BrokerLease(None, port=args.secure_port, echo=log, secure=True)
        with secure:
            conn = secure.broker.connection()
            log(f"secured: raw bus as admin over SASL_SSL at {secure.broker.bootstrap} ...")
            extra["secure_raw"] = raw_bus(conn, records)[0]
            log("secured: the pipeline, each stage as its role's principal ...")
            extra["secure"] = pipeline_run(conn, records, args.episodes, args.out / "secure", workers=args.stream_workers,
                                           principals=secure.broker.secure.directory, **kw)
    log(f"stage logs under {args.out}")

    pipe_s = result["elapsed"]
    raw_tps, pipe_tps = len(records) / raw_s, len(records) / pipe_s
    if args.workload != "default" or copies > 1:
        print(f"workload: {args.workload} ({args.distinct} distinct episodes x {copies} copies under new ids"
              + ("; responses 1000-4000 tokens per turn, sampling masks on)" if args.workload == "long" else ")"))
    print(f"turns: {len(records)}  episodes: {args.episodes}  payload: {payload / 1e6:.1f} MB")
    print(f"raw bus (produce + consume, no processing): {raw_tps:8.0f} turns/s  ({raw_s:.2f}s)")
    print(f"full pipeline (turns in, shards out):       {pipe_tps:8.0f} turns/s  ({pipe_s:.2f}s), "
          f"{response_tokens / pipe_s:.0f} response tokens/s")
    print(f"pipeline / raw bus: {pipe_tps / raw_tps:.2f}x  (target >= 0.5x)")
    latency_rows("", result)
    cpu_rows(result, raw_cpu, len(records), payload, workload, args)
    print(f"peak memory (VmHWM): {memory_text(result['memory'])}")
    if args.workload != "default" or args.stream_workers != 1:
        print(f"response tokens/s per stream worker: {response_tokens / pipe_s / args.stream_workers:.0f}  "
              f"({args.stream_workers} stream worker(s))")
    for workers in args.compare_workers:
        run = by_workers[workers]
        tps = len(records) / run["elapsed"]
        print(f"stream workers {workers}: {tps:8.0f} turns/s  ({run['elapsed']:.2f}s), {tps / workers:.0f} turns/s "
              f"per worker")
    for workers in (n for n in args.compare_workers if n > 1 and 1 in args.compare_workers):
        print(f"{workers} stream workers / 1: {by_workers[1]['elapsed'] / by_workers[workers]['elapsed']:.2f}x")
    if "memory" in extra:
        big = extra["memory"]["memory"]
        print(f"peak memory at 1x ({args.episodes} episodes): {memory_text(result['memory'])}")
        print(f"peak memory at 4x ({4 * args.episodes} episodes): {memory_text(big)}")
        print("peak memory 4x / 1x: " + ", ".join(f"{k} {big[k] / v:.2f}" for k, v in result["memory"].items())
              + "  (target <= 1.2)")
    if "secure" in extra:
        sraw_tps, spipe_tps = len(records) / extra["secure_raw"], len(records) / extra["secure"]["elapsed"]
        print(f"secured raw bus (SASL_SSL, SCRAM-SHA-512):  {sraw_tps:8.0f} turns/s  ({extra['secure_raw']:.2f}s)")
        print(f"secured full pipeline (stages as roles):    {spipe_tps:8.0f} turns/s  "
              f"({extra['secure']['elapsed']:.2f}s)")
        print(f"secured / plaintext: raw bus {sraw_tps / raw_tps:.2f}x, pipeline {spipe_tps / pipe_tps:.2f}x")
        latency_rows("secured ", extra["secure"])
    for k, paced in enumerate(extra.get("latency", [])):
        run = f" run {k + 1}/{args.paced_runs}" if args.paced_runs > 1 else ""
        print(f"paced{run} at {rate:.0f} turns/s ({args.pace:.0%} of {pipe_tps:.0f} turns/s; achieved "
              f"{len(records) / paced['sent_s']:.0f} turns/s over {paced['sent_s']:.2f}s)")
        latency_rows("paced ", paced)
    return 0


def interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted)  # even where a shell started it with SIGINT ignored
    signal.signal(signal.SIGTERM, interrupted)  # so every run's finally stops its stages
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted: stages stopped")
        sys.exit(130)
    except RuntimeError as exc:
        log(f"failed: {exc}")
        sys.exit(1)
