"""The faults a scenario injects, each a function of a ``FaultContext`` run in the fault thread.

Contract: a fault waits for its moment (an observation of the run), injects, and calls
``ctx.lifted()`` when the fault is over (a killed stage restarted, a paused one resumed, a broker
back up, the last malformed record sent); recovery is measured from there. A fault restores
what it broke (a killed broker or node is started again) before it returns.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from typing import Callable

from kafka import KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewPartitions

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.local_kafka.local_broker import LocalBroker, port_is_free
from rollout_bus.wire.headers import CONTROL_END_OF_RUN, TurnHeaders, control_kind
from tests.chaos.evidence import logged_episodes, records_below
from tests.chaos.harness import FaultContext, FaultNotInjected, Observation
from tests.topic_offsets import end_offsets

Fault = Callable[[FaultContext], None]
CHAOS_ID = "chaos.id"  # header naming each injected malformed record, kept by its dead letter


def _stage_moment(ctx: FaultContext, stage: str, i: int, times: int, last: Observation | None,
                  restarted_at: Observation | None) -> tuple[str, Callable[[Observation], bool]]:
    """When to hit ``stage`` the ``i``-th of ``times`` times: spread over the run, and only after
    the stage made progress since it was last restarted."""
    e = ctx.expected
    if stage == "generate":  # a restarted generator publishes again from the start: count from the restart
        base = restarted_at.turns if restarted_at else 0
        step = max(1, int(0.8 * e.turns * i / (times + 1)))
        return f"{step} turns sent since its start", lambda o: o.turns >= base + step
    if stage == "stream":
        want = max(1, e.episodes * i // (times + 1), (last.episodes + 1) if last else 0)
        return f"{want} episodes merged", lambda o: o.episodes >= want
    want = max(1, -(-e.batches * i // (times + 1)), (last.batches + 1) if last else 0)
    return f"{want} batches written", lambda o: o.batches >= want


def kill_stage(stage: str, times: int) -> Fault:
    """kill -9 ``stage`` ``times`` times while it works; each time it is started again at once. A later kill
    whose moment never comes because the run's work is all done (the restarted stage cleared its backlog
    between two observations) hits the stage then, named as such in the row's detail."""

    def fault(ctx: FaultContext) -> None:
        last = restarted = None
        moments = []
        for i in range(1, times + 1):
            what, moment = _stage_moment(ctx, stage, i, times, last, restarted)
            # after the first kill, a restarted stage may clear its whole backlog between two observations (the
            # harness reads the topics once per poll): the later kills then hit it with its work done, and say so
            last = ctx.wait_for(what, moment, or_when_done=i > 1)
            if not moment(last):
                what = f"the end of its work (before {what})"
            ctx.run.kill_stage(stage)
            ctx.lifted()
            moments.append(what)
            ctx.note(f"kill -9 #{i} of {stage} at {what}")
            restarted = ctx.observation_after(ctx.lifts[-1])
        ctx.note(f"{stage} killed at: " + ", ".join(moments))

    return fault


def kill_generator_in_flight(fraction: float = 0.4, tries: int = 100) -> Fault:
    """kill -9 the generator for good once ``fraction`` of the run's turns are sent, at a moment when the log
    holds an episode with turns and no final turn (the generator is stopped, the log read, and let go on
    until it does); the run is then closed with ``rollout-bus end-run``, as an operator would."""

    def fault(ctx: FaultContext) -> None:
        run, want = ctx.run, max(1, int(ctx.expected.turns * fraction))
        ctx.wait_for(f"{want} turns sent", lambda o: o.turns >= want)
        for _ in range(tries):
            run.signal_stage("generate", signal.SIGSTOP)
            if run.stages["generate"].poll() is not None:
                raise FaultNotInjected("the generator finished before an episode was in flight")
            open_now = logged_episodes(run.bootstrap, run.topics.turns).unfinished
            if open_now:
                break
            run.signal_stage("generate", signal.SIGCONT)
            ctx.sleep(0.05)
        else:
            raise FaultNotInjected(f"no episode was in flight in {tries} looks at the log")
        run.kill_stage("generate", restart=False)
        ctx.lifted()
        ctx.note(f"generate killed for good with {len(open_now)} episodes in flight; the run closed with end-run")

    return fault


def pause_stage(stage: str, seconds: float) -> Fault:
    """SIGSTOP ``stage`` for ``seconds`` while it works, then SIGCONT."""

    def fault(ctx: FaultContext) -> None:
        what, moment = _stage_moment(ctx, stage, 1, 3, None, None)
        ctx.wait_for(what, moment)
        ctx.run.signal_stage(stage, signal.SIGSTOP)
        try:
            ctx.sleep(seconds)
        finally:
            ctx.run.signal_stage(stage, signal.SIGCONT)
        ctx.lifted()
        ctx.note(f"SIGSTOP of {stage} for {seconds:.0f}s at {what}")

    return fault


def _mid_run(ctx: FaultContext, fraction: float = 0.25) -> str:
    want = max(1, int(ctx.expected.episodes * fraction))
    ctx.wait_for(f"{want} episodes merged", lambda o: o.episodes >= want)
    return f"{want} episodes merged"


def _kill_broker(broker: LocalBroker) -> int:
    pid = broker.status().pid
    if pid is None:
        raise RuntimeError(f"the broker at {broker.bootstrap} is not running; nothing to kill")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while not (port_is_free(broker.port) and port_is_free(broker.controller_port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    broker.stop()  # only clears the stale pid file now
    return pid


def broker_down(seconds: float, how: str, target: str = "single") -> Fault:
    """The single broker (``target="secure"``: the secured one) killed (``how="kill"``: kill -9) or stopped
    (``"stop"``: SIGTERM, a clean shutdown) mid-run, and started again ``seconds`` later on the same data."""

    def fault(ctx: FaultContext) -> None:
        broker = ctx.brokers.node(target)
        what = _mid_run(ctx)
        if how == "kill":
            _kill_broker(broker)
        else:
            broker.stop()
        ctx.note(f"broker {how} at {what}, down for {seconds:.0f}s")
        try:
            ctx.sleep(seconds)
        finally:
            broker.start(echo=lambda _m: None)
        ctx.lifted()

    return fault


def packet_drop(seconds: float) -> Fault:
    """Every packet to and from the single broker's port dropped (iptables DROP, not refused) mid-run for
    ``seconds``, then let through again; needs root and iptables (the row fails, saying so, without them)."""

    def fault(ctx: FaultContext) -> None:
        iptables = shutil.which("iptables")
        if iptables is None or subprocess.run([iptables, "-L", "INPUT", "-n"], capture_output=True).returncode:
            raise FaultNotInjected("iptables is not usable here (needs root and netfilter)")
        port = str(ctx.brokers.single.port)
        rules = [["INPUT", "-p", "tcp", "--dport", port, "-j", "DROP"],
                 ["INPUT", "-p", "tcp", "--sport", port, "-j", "DROP"]]
        what = _mid_run(ctx)
        added = []
        try:
            for rule in rules:
                subprocess.run([iptables, "-I", *rule], check=True)
                added.append(rule)
            ctx.note(f"packets to and from port {port} dropped at {what} for {seconds:.0f}s")
            ctx.sleep(seconds)
        finally:
            for rule in added:
                subprocess.run([iptables, "-D", *rule], check=False)
        ctx.lifted()

    return fault


def cluster_leader_kill(down_s: float = 20.0) -> Fault:
    """kill -9 the node leading rollout.turns partition 0 mid-run; recovery is measured from the
    kill (the cluster must fail over without it); the node is started again ``down_s`` later."""

    def fault(ctx: FaultContext) -> None:
        cluster = ctx.brokers.cluster
        what = _mid_run(ctx)
        leader = cluster.leader(ctx.run.topics.turns, 0)
        if leader is None:
            raise RuntimeError(f"{ctx.run.topics.turns}:0 has no leader to kill")
        cluster.kill(leader)
        ctx.lifted()
        ctx.note(f"kill -9 of node {leader} (leader of turns:0) at {what}")
        try:
            ctx.sleep(down_s)
        finally:
            cluster.start_node(leader)
            cluster.wait_fully_replicated()

    return fault


def cluster_rolling_restart() -> Fault:
    """Every node of the cluster stopped and started in turn mid-run (each waits for full replication)."""

    def fault(ctx: FaultContext) -> None:
        what = _mid_run(ctx, 0.2)
        took = ctx.brokers.cluster.rolling_restart()
        ctx.lifted()
        ctx.note(f"rolling restart at {what}: " + ", ".join(f"node {n} {s:.0f}s" for n, s in took.items()))

    return fault


def malformed_records(count: int, seed: int = 5) -> list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]:
    """``count`` turn records that must each be dead-lettered: (key, value, headers), each with a
    ``chaos.id`` header. Six shapes: garbage value, empty value, no turn headers, a non-numeric
    header, no key, and a well-formed rollout key of a group no generator makes with a garbage value."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        ident = [(CHAOS_ID, b"%d" % i)]
        good = TurnHeaders(turn=0, attempt=0, final=False, group_size=1, sent_at_ms=int(time.time() * 1000)).to_kafka()
        garbage = rng.randbytes(rng.randrange(1, 200))
        key = b"chaos-malformed-%d" % i
        shape = i % 6
        if shape == 0:
            out.append((key, garbage, good + ident))
        elif shape == 1:
            out.append((key, b"", good + ident))
        elif shape == 2:
            out.append((key, garbage, ident))
        elif shape == 3:
            out.append((key, garbage, [(k, b"x" if k == "turn" else v) for k, v in good] + ident))
        elif shape == 4:
            out.append((None, garbage, good + ident))
        else:
            out.append((b'[null,null,"rollout",%d,%d]' % (10_000_000 + i, i), garbage, good + ident))
    return out


def inject_malformed(count: int) -> Fault:
    """``count`` malformed records produced to rollout.turns while good episodes flow."""

    def fault(ctx: FaultContext) -> None:
        what = _mid_run(ctx, 0.1)
        producer = KafkaProducer(bootstrap_servers=ctx.run.bootstrap, acks="all", linger_ms=20)
        try:
            for key, value, headers in malformed_records(count):
                producer.send(ctx.run.topics.turns, key=key, value=value, headers=headers)
            producer.flush(timeout=120)
        finally:
            producer.close()
        ctx.lifted()
        ctx.note(f"{count} malformed records sent at {what}")

    return fault


def injected_ids(letters: list[DeadLetter]) -> Counter:
    """How many dead letters each injected record got, by its chaos.id."""
    found: Counter = Counter()
    for letter in letters:
        for name, value in letter.headers:
            if name == CHAOS_ID:
                found[int(value)] += 1
    return found


def all_injected_dead_lettered(count: int) -> Callable:
    """The scenario's extra condition: every injected record has reached the DLQ."""
    return lambda run: len(injected_ids(run.dead_letters())) >= count


def expire_turns(stopped_s: float = 5.0) -> Fault:
    """What retention does under a stalled stream worker, without waiting for a clock: the worker is
    SIGSTOPped mid-run, turns keep arriving unread for ``stopped_s``, then every record of rollout.turns
    up to its end is deleted (Kafka's DeleteRecords moves the log start, as an expired segment does),
    and the worker resumes. The end-of-run markers are never deleted (the run must still end), so the
    fault gives up if the generator has finished by then. The deleted count and the rollout keys the
    deleted records held go to the context: the row passes only if every lost episode is among them
    and the stages named the loss."""

    def fault(ctx: FaultContext) -> None:
        run = ctx.run
        what = _mid_run(ctx)
        run.signal_stage("stream", signal.SIGSTOP)
        try:
            ctx.sleep(stopped_s)
            ends = end_offsets(run.bootstrap, run.topics.turns)
            records = records_below(run.bootstrap, run.topics.turns, ends)
            if run.generator_done() or any(control_kind(r.headers) == CONTROL_END_OF_RUN for r in records):
                raise FaultNotInjected("the generator finished before the records could be deleted")
            admin = KafkaAdminClient(bootstrap_servers=run.bootstrap)
            try:
                admin.delete_records({TopicPartition(run.topics.turns, p): end for p, end in ends.items() if end})
            finally:
                admin.close()
            ctx.deleted = sum(ends.values())
            ctx.deleted_keys = {r.key.decode(errors="replace") for r in records if r.key}
            ctx.note(f"stream stopped at {what}; {ctx.deleted} records of rollout.turns deleted "
                     f"({len(ctx.deleted_keys)} episodes) {stopped_s:.0f}s later")
        finally:
            run.signal_stage("stream", signal.SIGCONT)
        ctx.lifted()

    return fault


def add_partitions(turns: int, episodes: int) -> Fault:
    """rollout.turns and rollout.episodes raised to ``turns`` and ``episodes`` partitions mid-run, then the
    generator killed and started again (it now hashes over the new count), as the operator did who
    found the loss: the stream worker and the writer must follow (they exit 75 and are started again)."""

    def fault(ctx: FaultContext) -> None:
        run = ctx.run
        what = _mid_run(ctx)
        admin = KafkaAdminClient(bootstrap_servers=run.bootstrap)
        try:
            admin.create_partitions({run.topics.turns: NewPartitions(total_count=turns),
                                     run.topics.episodes: NewPartitions(total_count=episodes)})
        finally:
            admin.close()
        ctx.sleep(2.0)
        run.kill_stage("generate")
        ctx.lifted()
        ctx.note(f"turns -> {turns}, episodes -> {episodes} partitions at {what}; generator restarted")

    return fault


def stage_log_says(stage: str, text: str) -> Callable:
    """A scenario condition: ``stage``'s log holds ``text`` (what an operator must have been told)."""

    def condition(run) -> bool:
        path = run.stages[stage].log_path
        return path.exists() and text in path.read_text(errors="replace")

    return condition


BALLOON = ".chaos-balloon"  # the file that fills the shard writer's disk


def small_disk(size_mb: int) -> tuple[Callable, Callable]:
    """A scenario's (setup, teardown): the run's shards directory on a tmpfs of its own, ``size_mb`` big
    (needs root: mount), and, after the run, its files copied back onto the ordinary disk and the tmpfs
    unmounted."""

    def setup(run) -> None:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            raise FaultNotInjected("mounting a small tmpfs needs root")
        run.shards_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "chaos-disk", str(run.shards_dir)],
                       check=True)

    def teardown(run) -> None:
        if not os.path.ismount(run.shards_dir):
            return
        (run.shards_dir / BALLOON).unlink(missing_ok=True)
        saved = run.shards_dir.with_name("shards.saved")
        shutil.copytree(run.shards_dir, saved)
        subprocess.run(["umount", str(run.shards_dir)], check=True)
        run.shards_dir.rmdir()
        saved.rename(run.shards_dir)

    return setup, teardown


def fill_disk(seconds: float) -> Fault:
    """The shard writer's disk filled mid-run (a file takes every free byte) for ``seconds``, then freed;
    the writer must wait, saying so, and write the same shards."""

    def fault(ctx: FaultContext) -> None:
        run = ctx.run
        want = max(1, ctx.expected.batches // 3)
        ctx.wait_for(f"{want} batches written", lambda o: o.batches >= want)
        balloon = run.shards_dir / BALLOON
        try:
            with open(balloon, "wb") as f:
                chunk = b"\0" * (1 << 20)
                try:
                    while True:
                        f.write(chunk)
                        f.flush()
                except OSError:
                    pass
            ctx.note(f"disk filled at {want} batches written for {seconds:.0f}s")
            ctx.sleep(seconds)
        finally:
            balloon.unlink(missing_ok=True)
        ctx.lifted()

    return fault
