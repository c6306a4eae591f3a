"""The chaos runner's judging, offline: recovery times, verdicts, the table, and that the injected records are bad.

No broker: these check that a row FAILS for each thing it is meant to catch (lost, duplicated,
changed shards, an injected record missing from the DLQ or dead-lettered twice, no progress).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_bus.wire.dead_letter import DeadLetter, DlqKind
from rollout_bus.observe.accounting import Reconciliation
from rollout_bus.streams.turn_record import Rejected, TurnRecord, parse_headers, parse_sample
from tests.chaos.faults import CHAOS_ID, malformed_records
from tests.chaos.evidence import log_excerpt
from tests.chaos.harness import ChaosRun, Expected, Observation, RunFacts, Signal, Workload, recovery_times
from tests.chaos.prompt_workload import PromptRun, PromptWorkload
from tests.chaos.runner import format_table, judge
from tests.chaos.scenarios import BY_NAME, FULL, QUICK

BATCHES = Signal(("batches",))


def _obs(t: float, batches: int) -> Observation:
    return Observation(t, turns=0, episodes=0, dead_letters=0, batches=batches)


def test_recovery_counts_from_the_first_observation_after_the_lift():
    history = [_obs(0, 1), _obs(1, 2), _obs(2, 2), _obs(3, 2), _obs(4, 3)]
    # the batch written at t=1 (before the fault was lifted at 1.5) is not the recovery
    assert recovery_times(history, [1.5], BATCHES, None) == [2.5]
    assert recovery_times(history, [4.5], BATCHES, None) == [None]  # no progress, never accounted for
    assert recovery_times(history, [4.5], BATCHES, 6.0) == [1.5]  # the run was accounted for first


def _facts(rec: Reconciliation | None, *, letters=(), digests=None, recoveries=(1.0,), failure=None) -> RunFacts:
    return RunFacts(rec, "summary", digests if digests is not None else {"a": "1"}, list(letters), list(recoveries),
                    failure, None, ["note"], 10.0)


def _ok(sent: int = 4) -> Reconciliation:
    return Reconciliation(sent=sent, in_shards=sent, batches=2)


EXPECTED = Expected(turns=10, episodes=4, batches=2, digests={"a": "1"})


def test_a_clean_run_passes_and_each_defect_fails_its_row(tmp_path):
    scenario = BY_NAME["quick-kill-stream"]
    assert judge("x", scenario, _facts(_ok()), EXPECTED, tmp_path).passed
    lost = Reconciliation(sent=4, in_shards=3, missing=["k"])
    assert judge("x", scenario, _facts(lost), EXPECTED, tmp_path).lost == 1
    assert not judge("x", scenario, _facts(lost), EXPECTED, tmp_path).passed
    twice = Reconciliation(sent=4, in_shards=3, duplicated={"k": [0, 1]})
    assert not judge("x", scenario, _facts(twice), EXPECTED, tmp_path).passed
    changed = judge("x", scenario, _facts(_ok(), digests={"a": "2"}), EXPECTED, tmp_path)
    assert not changed.passed and changed.identical == "NO" and "shards differ" in changed.detail
    stuck = judge("x", scenario, _facts(_ok(), recoveries=[None]), EXPECTED, tmp_path)
    assert not stuck.passed and "no progress" in stuck.detail
    stray = DeadLetter(b"k", b"v", [], "why", "stream", "decode", "t:0:1")
    assert not judge("x", scenario, _facts(_ok(), letters=[stray]), EXPECTED, tmp_path).passed
    crashed = judge("x", scenario, _facts(_ok(), failure="stage shards exited with code 1"), EXPECTED, tmp_path)
    assert not crashed.passed and crashed.identical == "-"


def _letter(ident: int, reason: str = "bad") -> DeadLetter:
    return DeadLetter(b"k", b"v", [(CHAOS_ID, b"%d" % ident)], reason, "stream", "decode", "t:0:1")


def test_injected_records_must_each_be_dead_lettered_exactly_once_with_a_reason(tmp_path):
    scenario = BY_NAME["quick-malformed-1k"]
    every = [_letter(i) for i in range(1000)]
    assert judge("m", scenario, _facts(_ok(), letters=every), EXPECTED, tmp_path).passed
    for letters in (every[:-1], every + [_letter(7)], every[:-1] + [_letter(999, reason="")]):
        row = judge("m", scenario, _facts(_ok(), letters=letters), EXPECTED, tmp_path)
        assert not row.passed and "injected records" in row.detail


def test_a_named_loss_passes_only_when_every_lost_episode_held_a_deleted_record_and_a_stage_said_so(tmp_path):
    scenario = BY_NAME["retention-expired"]
    lost = DeadLetter(None, None, [], "deleted", "stream", DlqKind.LOST, "t:0:5", lost=3)
    gap = DeadLetter(b"k2", b"v", [], "gap", "stream", DlqKind.GAP, "t:1:9")
    rec = Reconciliation(sent=4, in_shards=2, missing=["k1"], valid_in_dlq_only={"k2": ["gap"]},
                         lost=["stream: t:0 offsets 5..7 (3 records deleted before they were read)"])

    def row(rec, letters=(lost, gap), deleted=10, keys=frozenset({"k1", "k2"})):
        facts = _facts(rec, letters=letters)
        facts.deleted, facts.deleted_keys = deleted, set(keys)
        return judge("r", scenario, facts, EXPECTED, tmp_path)

    assert row(rec).passed, row(rec).problems
    assert "episodes lost that no deleted record held" in row(rec, keys={"k1"}).detail
    assert not row(Reconciliation(sent=4, in_shards=3, missing=["k1"]), letters=()).passed  # nobody said it
    assert "more than the 2 deleted" in row(rec, deleted=2).detail
    assert not row(Reconciliation(sent=4, in_shards=3, lost=rec.lost, duplicated={"k3": [0, 1]})).passed
    assert not row(rec, letters=(lost, gap, DeadLetter(b"k9", b"v", [], "?", "stream", "decode", "t:0:1"))).passed


def test_every_malformed_shape_is_rejected_by_the_stream_stage_parser():
    records = malformed_records(12)
    assert len({dict(h)[CHAOS_ID] for _, _, h in records}) == 12
    for key, value, headers in records:
        record = TurnRecord(key, value, headers, "t", 0, 0, 0)
        with pytest.raises(Rejected):
            parse_headers(record)
            parse_sample(record)


def test_table_is_aligned_and_names_every_scenario(tmp_path):
    rows = [judge(s.name, s, _facts(_ok()), EXPECTED, tmp_path) for s in QUICK]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["scenario", "lost", "dup"] and set(lines[1]) == {"-"}
    assert [line.split()[0] for line in lines[2:]] == [s.name for s in QUICK]
    assert {row.result for row in rows} == {"PASS", "FAIL"}  # the malformed row has no dead letters here
    assert len({line.index(row.result) for line, row in zip(lines[2:], rows)}) == 1


def test_scenario_names_are_unique_and_the_full_table_has_every_fault_of_the_brief():
    names = [s.name for s in FULL + QUICK]
    assert len(names) == len(set(names))
    assert {"kill-generator-x3", "kill-stream-x3", "kill-shards-x3", "sigstop-generate-15s", "sigstop-stream-15s",
            "sigstop-shards-15s", "broker-kill-30s", "broker-outage-120s", "cluster-leader-kill",
            "cluster-rolling-restart", "malformed-10k", "long-episodes-128k"} <= set(names)
    assert all(isinstance(s.workload.seed, int) and "--idle-flush-s" not in s.workload.generator_args for s in FULL)


def test_longest_episode_check_fails_when_shards_are_missing(tmp_path: Path):
    row = judge("long", BY_NAME["long-episodes-128k"], _facts(_ok()), EXPECTED, tmp_path)
    assert not row.passed and any("longest episode" in p for p in row.problems)


def test_quiet_for_counts_from_the_last_change_of_any_count(tmp_path: Path):
    run = ChaosRun("127.0.0.1:1", Workload("w", episodes=4), tmp_path, label="quiet")  # starts nothing
    assert run.quiet_for() == 0.0
    run.history = [_obs(0, 1), _obs(5, 2), _obs(9, 2), _obs(20, 2)]
    assert run.quiet_for() == 15.0
    run.history.append(Observation(21, turns=1, episodes=0, dead_letters=0, batches=2))  # a turn moved
    assert run.quiet_for() == 0.0


def test_log_excerpt_keeps_earlier_warnings_before_the_last_lines(tmp_path: Path):
    log = tmp_path / "stage.log"
    log.write_text("\n".join(["a INFO start", "b WARNING rollout_bus.streams.processor: dead letter kind=gap",
                              *[f"c INFO counts {i}" for i in range(20)]]))
    excerpt = log_excerpt(log, lines=3, warnings=5).splitlines()
    assert excerpt == ["b WARNING rollout_bus.streams.processor: dead letter kind=gap", "...",
                       "c INFO counts 17", "c INFO counts 18", "c INFO counts 19"]
    assert log_excerpt(tmp_path / "none.log", 3, 5) == "(no log)"


class _Exited:
    """A stage process stand-in that has exited with ``code`` (None: still running)."""

    def __init__(self, code: int | None):
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_a_prompt_workload_loads_distinct_prompt_groups_and_every_member_launch_is_a_new_member(tmp_path: Path):
    workload = PromptWorkload("p", episodes=20 * 4, generators=3)
    lines = [json.loads(line) for line in workload.prompt_lines()]
    assert len(lines) == 20 and len({line["id"] for line in lines}) == 20
    assert all(line["input_ids"] and line["n_samples"] == 4 for line in lines)
    run = workload.new_run("127.0.0.1:1", tmp_path, label="p")  # starts nothing
    assert isinstance(run, PromptRun) and run.stage_order() == ["stream", "shards", "generate", "generate-2",
                                                                "generate-3"]
    first, again = run._stage_args("generate"), run._stage_args("generate")  # started, then started again
    assert "--from-prompts" in first and first[first.index("--member-id") + 1] == "m1"
    assert again[again.index("--member-id") + 1] == "m2" and run.member_of["generate"] == "m2"
    assert first[first.index("--summary-out") + 1] != again[again.index("--summary-out") + 1]


def test_a_member_stopped_on_purpose_may_exit_143_and_is_done_only_with_its_summary(tmp_path: Path):
    run = PromptWorkload("p", episodes=8, generators=1).new_run("127.0.0.1:1", tmp_path, label="p")
    run._stage_args("generate")
    run.stages = {"stream": _Exited(None), "shards": _Exited(None), "generate": _Exited(143)}
    assert run.failed_stage() == "stage generate exited with code 143" and not run.members_done()
    run.stopped.add("generate")
    assert run.failed_stage() is None and not run.members_done()  # no summary yet
    run.summary_of("m1").write_text(json.dumps({"episodes": [["k", 0]]}))
    assert run.members_done() and run.sent() == [("k", 0)]
    run.stages["generate"] = _Exited(1)
    assert not run.members_done()  # stopped, yet it did not exit as a stopped one (the fault names its code)
