"""The chaos table: every scenario, its workload, its fault and what counts as recovering.

A workload's runs must write the same shards (same seed and options), so each scenario is
compared with one undisturbed run of its workload. The quick table is the short version that
``make test`` runs (tests/chaos/test_chaos_quick.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tests.chaos import faults
from tests.chaos.faults import Fault
from tests.chaos.harness import WRITER_ENDS, ChaosRun, Signal, Workload
from tests.chaos.http_workload import (HttpPromptWorkload, counting_tool_calls, engine_passed_over,
                                       kill_engine_mid_run, tools_ran_once)
from tests.chaos.prompt_workload import (MEMBER_FLAGS, PromptWorkload, kill_members, prompt_run_closed,
                                         prompt_run_resumed, scale_members)

STANDARD = Workload("standard", episodes=192)
SMALL = Workload("small", episodes=64)
# seed 25: one of the four episodes runs all 4 turns (128k response tokens), the others 1 turn each,
# which keeps the generator's part (torch sampling, about 1.5 ms a token here) near 5 minutes
LONG = Workload("long-128k", episodes=4, n_samples_per_prompt=2, seed=25, generator_args=(
    "--max-turns", "4", "--min-response-len", "32000", "--max-response-len", "32000"))
LONG_EPISODE_TOKENS = 4 * 32000
# two generators sharing one run, each with both adapters: each makes its share of the group indices
# the writer exits 0 at the run's end: a generator killed for good, the run closed with end-run
STANDARD_END = Workload("standard-end-run", episodes=192, writer_args=(WRITER_ENDS,))
SMALL_END = Workload("small-end-run", episodes=64, writer_args=(WRITER_ENDS,))
TWO_GENERATORS = Workload("two-generators", episodes=192, generators=2, generator_args=("--adapters", "math,code"))
# members of the generator group fed from rollout.prompts (the packaged prompts repeated), closing the run themselves
# (one prompt group in flight per member, 300 ms a turn: a kill lands mid-group; the one-member workload outlasts
# the ~20 s an added member takes to start on a 2-core machine)
PROMPTS_THREE = PromptWorkload("prompts-3-members", episodes=96 * 4, generators=3)
PROMPTS_ONE = PromptWorkload("prompts-1-member", episodes=44 * 4, generators=1)
# episodes of up to 6 turns, two prompt groups in flight per member: a kill lands on episodes part-way
PROMPTS_LONG = PromptWorkload("prompts-6-turns", episodes=48 * 4, generators=3, concurrency=2,
                              member_args=(*MEMBER_FLAGS, "--max-turns", "6"))
# members calling two fixture HTTP engines, with the tool environment, and one prompt group every engine dies on
PROMPTS_HTTP = HttpPromptWorkload("prompts-http-tools", episodes=96 * 2, n_samples_per_prompt=2, generators=2,
                                  concurrency=2)

# Recovery: the faulted stage's own output grows again (turns sent, episodes merged, batches written);
# for a broker, cluster or record fault, the pipeline's end product: the next batch on disk.
TURNS, EPISODES, BATCHES = Signal(("turns",)), Signal(("episodes",)), Signal(("batches",))
STAGE_SIGNAL = {"generate": TURNS, "stream": EPISODES, "shards": BATCHES}


def _always(_run: ChaosRun) -> bool:
    return True


@dataclass(frozen=True)
class Scenario:
    """One row of the table."""

    name: str
    description: str
    workload: Workload
    fault: Fault | None
    # "single": the runner's own broker; "cluster": its three-node cluster; "secure": its secured broker (TLS,
    # SCRAM, ACLs), each stage as its role's principal; its shards are compared with the plaintext baseline's
    target: str = "single"
    progress: Signal = BATCHES  # what must grow again after the fault is lifted
    timeout_s: float = 300.0
    condition: Callable[[ChaosRun], bool] = _always  # besides reconciliation, before the run is done
    injected: int = 0  # malformed records that must each be dead-lettered exactly once
    compare: bool = True  # shards compared with the workload's undisturbed run
    longest_episode: int = 0  # response tokens the longest episode in the shards must reach
    named_loss: bool = False  # the fault deletes records: every loss must be named (runner._named_loss_problems)
    unfinished: bool = False  # the generator killed for good: judged from the log (unfinished.unfinished_problems)
    setup: Callable[[ChaosRun], None] | None = None  # before the stages start (e.g. mount a small disk)
    teardown: Callable[[ChaosRun], None] | None = None  # after the facts are read


def _kills(stage: str, times: int, workload: Workload, name: str) -> Scenario:
    return Scenario(name, f"kill -9 of the {stage} stage {times}x, restarted at once", workload,
                    faults.kill_stage(stage, times), progress=STAGE_SIGNAL[stage])


def _pause(stage: str, seconds: float) -> Scenario:
    return Scenario(f"sigstop-{stage}-{seconds:.0f}s", f"SIGSTOP of the {stage} stage for {seconds:.0f}s, then SIGCONT",
                    STANDARD, faults.pause_stage(stage, seconds), progress=STAGE_SIGNAL[stage])


def _killed_for_good(workload: Workload, name: str) -> Scenario:
    return Scenario(name, "kill -9 of the generator with episodes in flight, not restarted; the run closed with "
                    "end-run: those episodes dead-lettered unfinished, short groups flagged, the writer exits 0",
                    workload, faults.kill_generator_in_flight(), compare=False, unfinished=True, progress=BATCHES,
                    condition=lambda run: run.stages["shards"].poll() == 0)


def _malformed(count: int, workload: Workload, name: str) -> Scenario:
    return Scenario(name, f"{count} malformed records into rollout.turns while good episodes flow", workload,
                    faults.inject_malformed(count), condition=faults.all_injected_dead_lettered(count),
                    injected=count)


# the shard writer's --out on a 256 MB tmpfs of its own (mounted before the run, copied back after it)
SMALL_DISK_SETUP, SMALL_DISK_TEARDOWN = faults.small_disk(256)

FULL = [
    _kills("generate", 3, STANDARD, "kill-generator-x3"),
    _kills("stream", 3, STANDARD, "kill-stream-x3"),
    _kills("shards", 3, STANDARD, "kill-shards-x3"),
    _pause("generate", 15),
    _pause("stream", 15),
    _pause("shards", 15),
    Scenario("broker-kill-30s", "the broker killed (kill -9) mid-run, started again 30 s later", STANDARD,
             faults.broker_down(30, "kill"), timeout_s=420),
    Scenario("secure-broker-kill-30s", "the secured broker (TLS, SCRAM, ACLs; each stage its role's principal) "
             "killed (kill -9) mid-run, started again 30 s later", STANDARD, faults.broker_down(30, "kill", "secure"),
             target="secure", timeout_s=420),
    Scenario("broker-outage-120s", "the broker stopped mid-run, started again 120 s later", STANDARD,
             faults.broker_down(120, "stop"), timeout_s=600),
    Scenario("cluster-leader-kill", "3-node cluster: kill -9 of the leader of turns:0 mid-run (back 20 s later; "
             "recovery counted from the kill)", STANDARD, faults.cluster_leader_kill(20), target="cluster",
             timeout_s=420),
    Scenario("cluster-rolling-restart", "3-node cluster: every node stopped and started in turn mid-run",
             STANDARD, faults.cluster_rolling_restart(), target="cluster", timeout_s=480),
    Scenario("packet-drop-60s", "every packet to and from the broker's port dropped (iptables DROP) mid-run for "
             "60 s; the stream worker must say it waits for the broker", STANDARD, faults.packet_drop(60),
             timeout_s=480, condition=faults.stage_log_says("stream", "waiting for broker: no answer from")),
    _malformed(10_000, STANDARD, "malformed-10k"),
    Scenario("retention-expired", "the stream worker stopped mid-run and rollout.turns deleted under it up to its "
             "end (DeleteRecords, as retention does); every lost episode must be named", STANDARD,
             faults.expire_turns(), compare=False, named_loss=True, progress=EPISODES,
             condition=faults.stage_log_says("shards", "end of run run=")),
    Scenario("partitions-added", "rollout.turns 4 -> 8 and rollout.episodes 4 -> 6 partitions mid-run, then the "
             "generator restarted; the stream worker and the writer exit 75 and are started again", STANDARD,
             faults.add_partitions(8, 6), timeout_s=420),
    Scenario("two-generators-kill", "two generators with adapters math and code share one run (groups split "
             "between them); kill -9 of the first once", TWO_GENERATORS, faults.kill_stage("generate", 1),
             progress=TURNS),
    Scenario("disk-full-30s", "the shard writer's disk (a 256 MB tmpfs) filled mid-run for 30 s, then freed; "
             "the writer must wait, saying so", STANDARD, faults.fill_disk(30), timeout_s=420,
             condition=faults.stage_log_says("shards", "waiting for disk space"),
             setup=SMALL_DISK_SETUP, teardown=SMALL_DISK_TEARDOWN),
    _killed_for_good(STANDARD_END, "generator-killed-end-run"),
    Scenario("prompts-kill-member-x3", "3 members of the generator group fed from rollout.prompts: kill -9 of a member "
             "holding a prompt group 3x, 20 s apart (sooner at 1/2, 3/4 of the groups done), a new member started "
             "each time; the run closes itself",
             PROMPTS_THREE, kill_members(3, 20), progress=TURNS, condition=prompt_run_closed),
    Scenario("prompts-scale-1-3-1", "the generator group fed from rollout.prompts scaled 1 -> 3 members mid-run, then "
             "3 -> 1 (two holding prompt groups stopped with SIGTERM, handing back); the run closes itself",
             PROMPTS_ONE, scale_members(2, 2), progress=TURNS, condition=prompt_run_closed),
    Scenario("prompts-resume-kill-mid-episode", "episodes of up to 6 turns: kill -9 of a member holding prompt groups "
             "part-way (turns of unfinished episodes on the log) 3x; its takers resume them from the log",
             PROMPTS_LONG, kill_members(3, 15, part_way=True), progress=TURNS, condition=prompt_run_resumed),
    Scenario("prompts-http-engine-kill", "members calling a pool of 2 HTTP engines (tool environment, a prompt group "
             "every engine dies on, failed once): one engine killed -9 mid-request, back 10 s later",
             PROMPTS_HTTP, kill_engine_mid_run(0, 10), progress=TURNS, condition=engine_passed_over(0)),
    Scenario("prompts-http-kill-member-tools", "members calling HTTP engines, with the tool environment: kill -9 of a "
             "member holding episodes part-way 2x; every tool call of the undisturbed run runs, none whose result "
             "was on the log runs again", PROMPTS_HTTP, counting_tool_calls(kill_members(2, 10, part_way=True)),
             progress=TURNS, condition=tools_ran_once),
    Scenario("long-episodes-128k", "episodes of up to 4 turns x 32k response tokens (128k) must reach the shards",
             LONG, None, timeout_s=1200, compare=False, longest_episode=LONG_EPISODE_TOKENS),
]

QUICK = [
    _kills("stream", 1, SMALL, "quick-kill-stream"),
    _kills("shards", 1, SMALL, "quick-kill-shards"),
    _malformed(1_000, SMALL, "quick-malformed-1k"),
    _killed_for_good(SMALL_END, "quick-generator-killed-end-run"),
    Scenario("quick-broker-kill-10s", "the broker killed (kill -9) mid-run, started again 10 s later", SMALL,
             faults.broker_down(10, "kill")),
    Scenario("quick-secure-broker-kill-10s", "the secured broker (TLS, SCRAM, ACLs; each stage its role's "
             "principal) killed (kill -9) mid-run, started again 10 s later", SMALL,
             faults.broker_down(10, "kill", "secure"), target="secure"),
]

BY_NAME = {s.name: s for s in FULL + QUICK}
