"""The demo's reconciliation: a valid episode only in the DLQ fails the run; deliberate faults do not."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_bus.wire.dead_letter import DeadLetter
from rollout_bus.observe.accounting import reconcile

GAP = '[null,null,"rollout",0,0]'
MATE = '[null,null,"rollout",0,1]'
OTHER = '[null,null,"rollout",1,0]'
PLACED = '[null,null,"rollout",2,0]'
SENT = [(GAP, 0), (MATE, 0), (OTHER, 0), (PLACED, 1)]
FAULTS = [{"kind": "replay-gap", "key": GAP, "attempt": 0},
          {"kind": "malformed", "key": '[null,null,"rollout",1000000,0]', "attempt": 0, "turn": 0}]


def batch(out: Path, seq: int, *keys_attempts: tuple[str, int]) -> None:
    path = out / f"batch-{seq:06d}"
    path.mkdir(parents=True)
    manifest = {"seq": seq, "extra": {"episodes": [{"key": k, "attempt": a} for k, a in keys_attempts]}}
    (path / "manifest.json").write_text(json.dumps(manifest))


def letter(key: str, kind: str, stage: str = "shards") -> DeadLetter:
    return DeadLetter(key.encode(), b"", [], f"because {kind}", stage, kind, "t.rollout.episodes:0:1")


def test_everything_in_a_batch_is_ok(tmp_path):
    batch(tmp_path, 0, *SENT)
    result = reconcile(SENT, tmp_path, [], verify=False)
    assert result.ok and result.settled and result.in_shards == 4 and result.valid_in_dlq_only == {}


def test_a_valid_episode_only_in_the_dlq_fails_the_run_and_is_named(tmp_path):
    batch(tmp_path, 0, (GAP, 0), (MATE, 0), (PLACED, 1))
    result = reconcile(SENT, tmp_path, [letter(OTHER, "merge", "stream")], verify=False)
    assert result.settled and not result.ok and result.in_dlq_only == 1
    assert result.valid_in_dlq_only == {OTHER: ["merge"]}
    assert any("1 valid episodes only in the DLQ" in p and OTHER in p for p in result.problems())


def test_the_replay_gap_and_its_mask_check_batch_mates_may_be_in_the_dlq_when_faults_were_injected(tmp_path):
    batch(tmp_path, 1, (OTHER, 0), (PLACED, 1))
    dead = [letter(GAP, "mask-check"), letter(MATE, "mask-check")]
    result = reconcile(SENT, tmp_path, dead, verify=False, faults=FAULTS)
    assert result.ok and result.in_dlq_only == 2 and result.in_shards == 2


def test_a_failed_mask_check_without_injected_faults_is_a_real_loss(tmp_path):
    batch(tmp_path, 1, (OTHER, 0), (PLACED, 1))
    dead = [letter(GAP, "mask-check"), letter(MATE, "mask-check")]
    result = reconcile(SENT, tmp_path, dead, verify=False)
    assert not result.ok and set(result.valid_in_dlq_only) == {GAP, MATE}


def test_with_faults_only_mask_check_batch_mates_are_excused_not_other_dead_letters(tmp_path):
    batch(tmp_path, 1, (PLACED, 1))
    dead = [letter(GAP, "mask-check"), letter(MATE, "mask-check"), letter(OTHER, "abandoned", "stream")]
    result = reconcile(SENT, tmp_path, dead, verify=False, faults=FAULTS)
    assert not result.ok and result.valid_in_dlq_only == {OTHER: ["abandoned"]}


def test_an_episode_in_a_batch_and_also_dead_lettered_counts_as_placed(tmp_path):
    batch(tmp_path, 0, *SENT)  # e.g. the `finished` fault: a late turn of an episode that was written
    result = reconcile(SENT, tmp_path, [letter(PLACED, "finished", "stream")], verify=False, faults=FAULTS)
    assert result.ok and result.in_shards == 4 and result.in_dlq_only == 0


def test_an_episode_neither_placed_nor_dead_lettered_is_not_settled(tmp_path):
    batch(tmp_path, 0, (GAP, 0), (MATE, 0), (OTHER, 0))
    result = reconcile(SENT, tmp_path, [], verify=False)
    assert not result.settled and not result.ok and result.missing == [PLACED]


def test_records_deleted_before_a_stage_read_them_fail_the_run_naming_topic_partition_offsets_and_count(tmp_path):
    from rollout_bus.wire.dead_letter import lost_letter

    batch(tmp_path, 0, (GAP, 0), (MATE, 0), (PLACED, 1))
    dead = [lost_letter("stream", "t.rollout.turns", 3, 12, 75, 87)]
    result = reconcile(SENT, tmp_path, dead, verify=False)
    assert not result.ok and result.missing == [OTHER]
    assert result.lost == ["stream: t.rollout.turns:3 offsets 12..86 (75 records deleted before they were read)"]
    assert result.problems()[0].startswith("LOST: stream: t.rollout.turns:3 offsets 12..86")


def test_a_group_written_short_is_listed_by_batch_and_group_without_failing_the_run(tmp_path):
    batch(tmp_path, 0, *SENT)
    manifest_path = tmp_path / "batch-000000" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["extra"]["groups"] = [{"adapter": None, "group_index": 16, "group_size": 4, "episodes": 3,
                                    "abandoned": 0, "complete": False},
                                   {"adapter": None, "group_index": 17, "group_size": 4, "episodes": 3,
                                    "abandoned": 1, "complete": True}]
    manifest_path.write_text(json.dumps(manifest))
    result = reconcile(SENT, tmp_path, [letter(OTHER, "unfinished", "stream")], verify=False)
    assert result.incomplete_groups == ["batch 0: group (adapter=None, group_index=16) holds 3 episodes and "
                                        "0 abandoned of 4"]
    assert result.ok and result.dlq_reasons == {"stream/unfinished": 1}
