"""The elastic generator group on the real broker: every prompt group exactly once, whatever happens to members.

Each run loads the same prompt groups, runs a stream worker and a shard writer, and members of the group
(``rollout-bus generate --from-prompts`` processes); a disturbed run (a member killed -9, stopped past its session
and resumed as a zombie, the group scaled 1 -> 3 -> 1) must write shards byte-identical to the undisturbed run's,
end with every prompt group done in the ledger, and close itself (the writer exits on the run's end). The
response tokens a takeover threw away reach the batches' flow: their ``takeover`` cause on rollout.metrics sums to
the stream worker's own ``takeover_tokens_discarded`` count (0 when a kill landed before any turn was stored).
"""

from __future__ import annotations

import json
import re
import signal
import time
import uuid

import pytest

from rollout_bus.kafka.admin import ensure_topics
from rollout_bus.kafka.prompt_ledger import read_ledger
from rollout_bus.kafka.reader import TopicReader
from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.wire.flow_metrics import CAUSE_TAKEOVER, discarded_tokens
from rollout_bus.wire.metrics_records import METRIC_PREFIX
from rollout_bus.wire.prompt_record import PromptGroup
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.topics import Topics
from tests.integration.pipeline_harness import wait_until
from tests.integration.prompt_group_harness import (Member, ledger_counts, put_prompts, shard_digests,
                                                    synthetic_prompts)
from tests.integration.test_shard_writer_control import WriterThread
from tests.integration.test_stream_worker import Worker

pytestmark = pytest.mark.kafka

GROUPS, SAMPLES = 24, 4
PACED = ("--turn-latency-ms", "150", "--concurrency", "2")


class Run:
    """Fresh topics, the prompts loaded, a stream worker and a shard writer waiting for them; ``close()`` kills
    whatever is still running (a failed test leaves no member behind)."""

    def __init__(self, bootstrap: str, client_kwargs: dict, tmp_path, prompts: list[PromptGroup]) -> None:
        self.bootstrap, self.client_kwargs = bootstrap, client_kwargs
        self.topics = Topics(prefix=f"g{uuid.uuid4().hex[:10]}.")
        self.dir = tmp_path / self.topics.prefix.rstrip(".")
        self.dir.mkdir()
        ensure_topics(client_kwargs, self.topics)
        put_prompts(client_kwargs, self.topics, prompts)
        self.worker = Worker(bootstrap, self.topics, self.topics.group("rollout-bus-stream"), self.dir)
        self.writer = WriterThread(client_kwargs, self.topics, self.dir / "shards",
                                   self.topics.group("rollout-bus-shards"), run_batching=RunBatching(2))
        self.members: list[Member] = []

    def close(self) -> None:
        for member in self.members:
            member.signal(signal.SIGKILL)
        if self.worker.proc.poll() is None:
            self.worker.stop(signal.SIGKILL)
        if self.writer.thread.is_alive():
            self.writer.writer.stop()

    def member(self, *extra: str) -> Member:
        member = Member(self.bootstrap, self.topics, self.dir, *extra)
        self.members.append(member)
        return member

    def ledger(self) -> dict[str, int]:
        return ledger_counts(self.client_kwargs, self.topics)

    def holds(self, member: Member, *, turns: int = 0) -> bool:
        """Whether ``member`` has a prompt group claimed and not yet done, as the ledger says (with ``turns``: one
        with at least that many of its turns acknowledged and noted)."""
        ledger = read_ledger(self.client_kwargs, self.topics)
        return any(g == member.name and p not in ledger.ended
                   and sum(len(e.marks) for e in ledger.progress.get(p, {}).values()) >= turns
                   for p, g in ledger.claimant.items())

    def finish(self) -> dict[str, str]:
        """Wait for the run to close itself and the writer to write its last batch; the shards' digests."""
        logs = lambda: {m.name: m.log()[-1500:] for m in self.members}  # noqa: E731
        self.writer.wait_until(lambda: not self.writer.thread.is_alive(), "the run closed itself", timeout=240)
        for member in self.members:  # killed (-9), stopped by SIGTERM (143), or done by itself (0)
            assert member.wait(60) in (0, -signal.SIGKILL, 128 + signal.SIGTERM), logs()
        self.worker.stop()
        return shard_digests(self.dir / "shards")

    def takeover_tokens_in_batches(self) -> float:
        """The batches' discarded ``takeover`` tokens (their rollout.metrics records), summed over distinct batches."""
        reader = TopicReader(self.client_kwargs, [self.topics.metrics])
        try:
            docs = [json.loads(r.value) for r in reader.read_to_end().get(self.topics.metrics, [])]
        finally:
            reader.close()
        batches = {doc["batch"]: doc["metrics"] for doc in docs if doc.get("kind") == "batch"}
        assert batches, "no batch record on rollout.metrics"
        return sum(metrics[METRIC_PREFIX + discarded_tokens(CAUSE_TAKEOVER)] for metrics in batches.values())

    def takeover_tokens_discarded(self) -> int:
        """What the stream worker (stopped by ``finish``) counted as thrown away by takeovers."""
        counts = self.worker.counts()
        assert counts, self.worker.log()[-2000:]
        return counts.get("takeover_tokens_discarded", 0)

    def dead_letters(self) -> list[DeadLetter]:
        reader = TopicReader(self.client_kwargs, [self.topics.dlq])
        try:
            return [DeadLetter.from_record(r.key, r.value, r.headers)
                    for r in reader.read_to_end().get(self.topics.dlq, [])]
        finally:
            reader.close()


@pytest.fixture
def new_run(kafka_bootstrap, client_kwargs, tmp_path):
    """``new_run(prompts)``: a ``Run`` on them, closed at the test's end whatever happened."""
    runs: list[Run] = []

    def make(prompts: list[PromptGroup]) -> Run:
        runs.append(Run(kafka_bootstrap, client_kwargs, tmp_path, prompts))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


@pytest.fixture(scope="module")
def undisturbed(kafka_bootstrap, tmp_path_factory) -> dict[str, str]:
    """The shards of one member making every prompt group, nothing disturbed."""
    run = Run(kafka_bootstrap, {"bootstrap_servers": kafka_bootstrap}, tmp_path_factory.mktemp("undisturbed"),
              synthetic_prompts(GROUPS, SAMPLES))
    try:
        run.member("--concurrency", "4")
        digests = run.finish()
    finally:
        run.close()
    assert len(digests) == GROUPS, digests  # batches of 2 groups, 2 DP shards each
    assert run.ledger() == {"loaded": GROUPS, "done": GROUPS, "failed": 0, "in_flight": 0, "redelivered": 0}
    assert run.takeover_tokens_in_batches() == run.takeover_tokens_discarded() == 0
    return digests


def test_a_member_killed_mid_group_costs_nothing_its_groups_are_delivered_again(
        new_run, undisturbed):
    run = new_run(synthetic_prompts(GROUPS, SAMPLES))
    # the victim alone and slow (3 s an engine call): it holds prompt groups in flight, some of their turns on the
    # log, when it is killed, however loaded the machine (the shards do not depend on pace); the others start after
    victim = run.member("--turn-latency-ms", "3000", "--concurrency", "2")
    wait_until(lambda: run.holds(victim, turns=1), 120, "the victim holding a prompt group with a turn on the log")
    victim.kill()  # kill -9 with a prompt group in flight: a claim without a done, some of its turns published
    others = [run.member(*PACED) for _ in range(2)]
    digests = run.finish()
    assert digests == undisturbed
    ledger = run.ledger()
    assert (ledger["done"], ledger["failed"], ledger["in_flight"]) == (GROUPS, 0, 0), ledger
    assert ledger["redelivered"] >= 1, ledger
    assert all(m.summary()["closed_run"] or m.summary()["done"] >= 0 for m in others)
    assert run.takeover_tokens_in_batches() == run.takeover_tokens_discarded()
    # resumed from the log, not made again: the takers found the victim's turns and sent them no second time
    summaries = [m.summary() for m in others]
    assert sum(s["turns_reused"] for s in summaries) >= 1, summaries
    counts = run.worker.counts()
    assert counts.get("resumed_episodes", 0) + sum(s["episodes_reused"] for s in summaries) >= 1, counts


def test_a_zombie_back_from_sigstop_is_fenced_and_the_shards_are_unchanged(
        new_run, undisturbed):
    run = new_run(synthetic_prompts(GROUPS, SAMPLES))
    zombie = run.member(*PACED)
    wait_until(lambda: run.holds(zombie), 120, "the first member holding a prompt group")
    zombie.signal(signal.SIGSTOP)
    survivor = run.member(*PACED)
    wait_until(lambda: run.ledger()["redelivered"] >= 1, 120, "the survivor taking the zombie's prompt groups over")
    zombie.signal(signal.SIGCONT)
    digests = run.finish()
    assert digests == undisturbed
    assert "no longer holds its prompts partitions" in zombie.log()
    assert run.ledger()["done"] == GROUPS and survivor.summary()["redelivered"] >= 1
    assert run.takeover_tokens_in_batches() == run.takeover_tokens_discarded()


def _holds_partitions(member: Member) -> bool:
    return re.search(r"took prompts partitions \[\d", member.log()) is not None


def test_scaling_one_to_three_and_back_to_one_keeps_every_prompt_group_once(
        new_run, undisturbed):
    run = new_run(synthetic_prompts(GROUPS, SAMPLES))
    first = run.member("--turn-latency-ms", "500", "--concurrency", "1")  # alone: about a second a prompt group
    wait_until(lambda: run.ledger()["done"] >= 2, 120, "two prompt groups done by the first member")
    added = [run.member(*PACED) for _ in range(2)]
    wait_until(lambda: all(_holds_partitions(m) for m in added), 120, "the added members holding partitions")
    assert run.ledger()["done"] < GROUPS, "the first member finished alone: nothing was scaled"
    for member in added:
        member.signal(signal.SIGTERM)  # a clean stop: what it holds finishes or goes back to the group
    for member in added:
        assert member.wait(120) == 128 + signal.SIGTERM, member.log()[-2000:]
    digests = run.finish()
    assert digests == undisturbed
    assert run.ledger()["done"] == GROUPS and first.proc.returncode == 0
    assert sum(m.summary()["done"] for m in added) >= 1  # the added members did share the work


def test_a_prompt_the_engine_always_refuses_is_failed_after_its_deliveries_and_the_run_still_ends(new_run):
    prompts = synthetic_prompts(4, SAMPLES)
    bad = PromptGroup("q-refused", 4, [7, 8, 9], SAMPLES, sampling={"top_p": 5.0})
    run = new_run(prompts + [bad])
    member = run.member("--max-deliveries", "2")
    run.finish()
    assert member.proc.returncode == 0, member.log()[-2000:]
    ledger = run.ledger()
    assert (ledger["done"], ledger["failed"]) == (4, 1), ledger
    [letter] = [d for d in run.dead_letters() if d.kind == "failed_prompt"]
    assert letter.key == b"q-refused" and letter.stage == "generator"
    assert "delivered 2 times" in letter.reason and "'top_p' must be in (0, 1]" in letter.reason


@pytest.mark.chaos
@pytest.mark.timeout(1200)
def test_one_member_of_three_killed_every_20s_for_two_minutes_changes_no_shard(kafka_bootstrap, new_run, tmp_path):
    """The issue's drill (``pytest -m chaos``): kill -9 of one member of three every 20 s for 120 s, a new member
    started in its place each time; the shards are those of an undisturbed run of the same prompts."""
    prompts = synthetic_prompts(450, SAMPLES, seed=1)
    calm = new_run(prompts)
    calm.member("--concurrency", "8")
    reference = calm.finish()
    run = new_run(prompts)
    alive = [run.member("--turn-latency-ms", "400", "--concurrency", "1") for _ in range(3)]
    kills = 0
    for _ in range(6):
        wait_until(lambda: any(run.holds(m) for m in alive), 60, "a member holding a prompt group")
        victim = next(m for m in alive if run.holds(m))
        victim.kill()
        kills += 1
        alive.remove(victim)
        alive.append(run.member("--turn-latency-ms", "400", "--concurrency", "1"))
        if run.ledger()["done"] >= len(prompts) - 10:
            break
        time.sleep(20)
    digests = run.finish()
    assert kills >= 4, f"the run ended after {kills} kills: give it more prompt groups"
    assert digests == reference
    ledger = run.ledger()
    assert (ledger["done"], ledger["failed"], ledger["in_flight"]) == (len(prompts), 0, 0), ledger
    assert ledger["redelivered"] >= kills, ledger
