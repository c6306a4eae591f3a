"""rollout_bus.consumers.shard_writer.decide: the one batch decision of the shard writer and replay."""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout_bus.errors import MaskCheckError
from rollout_bus.model.sample import Sample, Status
from rollout_bus.model.sampling_mask import RolloutSamplingMask
from rollout_bus.consumers.shard_writer.batch import split_stale
from rollout_bus.consumers.shard_writer.batcher import Batcher, Episode
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.consumers.shard_writer.decide import Verdict, decide, write_decided
from rollout_bus.consumers.shard_writer.out_dir import convert_batch, write_batch
from rollout_bus.wire.dead_letter import DlqKind
from rollout_bus.wire.rollout_key import rollout_key_string

G = 2  # groups per batch: batch 3 holds groups 6 and 7


def segment(group_index: int, rid: int, version: int, *, mask: bool = True, length: int = 3) -> Sample:
    tokens = np.arange(5 + length, dtype=np.int64) + 10 * rid
    return Sample(group_index=group_index, index=rid, rollout_id=rid, tokens=tokens, response_length=length,
                  reward=float(rid % 2), loss_mask=[1] * length, rollout_log_probs=[-0.5] * length,
                  rollout_sampling_mask=RolloutSamplingMask.from_mask_list([[int(t), 7] for t in tokens[-length:]])
                  if mask else None, rollout_token_versions=np.full(length, version, dtype=np.int64),
                  status=Status.COMPLETED)


def episode(group_index: int, rid: int, version: int = 3, *, segments: int = 1, mask: bool = True) -> Episode:
    key = rollout_key_string((None, "rollout", group_index, rid))
    parts = tuple(segment(group_index, rid, version, mask=mask) for _ in range(segments))
    return Episode(key, 0, 2, parts, 0, 2 * group_index + rid, value=f"v{group_index}.{rid}".encode())


def batch_3(*episodes: Episode):
    batcher = Batcher(RunBatching(G, "step"))
    for e in episodes:
        batcher.add(e)
    [batch] = batcher.ready()
    assert batch.seq == 3
    return batch


def decided(batch, max_staleness=None):
    return decide(batch, dp_size=2, normalization="grpo", batching="step", max_staleness=max_staleness)


def test_a_batch_that_passes_is_written_as_the_convert_and_write_steps_write_it(tmp_path):
    batch = batch_3(*(episode(g, r) for g in (6, 7) for r in (0, 1)))
    decision = decided(batch)
    assert decision.verdict is Verdict.WRITE and decision.batch is batch and decision.error is None
    assert decision.dead_letters() == [] and decision.why == ""

    manifest = write_decided(tmp_path / "a", decision, topic="rollout.episodes")
    samples, ranks = convert_batch(batch, dp_size=2, normalization="grpo")
    expected = write_batch(tmp_path / "b", batch, samples, ranks, topic="rollout.episodes", batching="step",
                           normalization="grpo")
    assert manifest == expected
    names = sorted(p.name for p in (tmp_path / "a" / "batch-00000003").iterdir())
    assert len(names) == 3 and names == sorted(p.name for p in (tmp_path / "b" / "batch-00000003").iterdir())
    for name in names:
        assert (tmp_path / "a" / "batch-00000003" / name).read_bytes() == \
            (tmp_path / "b" / "batch-00000003" / name).read_bytes()


def test_stale_episodes_are_dead_lettered_and_the_rest_written_with_the_bound_in_the_manifest(tmp_path):
    fresh = [episode(6, 0, 3), episode(6, 1, 2), episode(7, 0, 3)]
    old = episode(7, 1, 0)  # 0 < 3 - 2
    decision = decided(batch_3(*fresh, old), max_staleness=2)
    assert decision.verdict is Verdict.WRITE
    assert [e.key for e in decision.batch.episodes] == [e.key for e in fresh]
    [letter] = decision.dead_letters()
    assert letter.episode is old and letter.kind == DlqKind.STALE
    assert letter.reason == decision.batch.stale[0].reason
    manifest = write_decided(tmp_path, decision, topic="rollout.episodes")
    assert manifest["extra"]["max_staleness"] == 2 and [s["key"] for s in manifest["extra"]["stale"]] == [old.key]


def test_a_batch_left_without_episodes_is_empty_and_says_why():
    batch = batch_3(*(episode(g, r, 0) for g in (6, 7) for r in (0, 1)))
    decision = decided(batch, max_staleness=1)
    assert decision.verdict is Verdict.EMPTY and decision.batch.empty and decision.ranks is None
    assert [d.kind for d in decision.dead_letters()] == [DlqKind.STALE] * 4
    assert decision.emptied_by == "abandoned or stale"
    assert decision.why == "every episode of it was abandoned or stale (0 abandoned, 4 stale episodes)"
    emptied = dataclasses.replace(batch, episodes=())  # as if every group had been abandoned
    assert decided(emptied).why == "every episode of it was abandoned (0 abandoned, 0 stale episodes)"


def test_a_batch_the_mask_check_refuses_dead_letters_every_episode_with_its_batch_positions():
    episodes = [episode(6, 0, segments=2), episode(6, 1, mask=False), episode(7, 0), episode(7, 1)]
    decision = decided(batch_3(*episodes))
    assert decision.verdict is Verdict.DEAD_LETTER and isinstance(decision.error, MaskCheckError)
    assert decision.kind == DlqKind.MASK_CHECK and decision.why == f"mask-check: {decision.error}"
    letters = decision.dead_letters()
    assert [d.episode.key for d in letters] == [e.key for e in decision.batch.episodes]
    assert {d.kind for d in letters} == {DlqKind.MASK_CHECK}
    spans = [d.reason.rsplit("held batch positions ", 1)[1] for d in letters]
    assert spans == ["0..1", "2..2", "3..3", "4..4"]
    assert letters[0].reason.startswith(f"batch 3 (4 episodes) failed the whole-batch check: {decision.error}; "
                                        f"this episode ({letters[0].episode.key}, attempt 0)")


def test_stale_letters_come_first_and_the_staleness_split_is_the_batchs_when_it_is_then_refused():
    episodes = [episode(6, 0, 0), episode(6, 1, 3, mask=False), episode(7, 0), episode(7, 1)]
    decision = decided(batch_3(*episodes), max_staleness=1)
    assert decision.verdict is Verdict.DEAD_LETTER
    assert [d.kind for d in decision.dead_letters()] == [DlqKind.STALE] + [DlqKind.MASK_CHECK] * 3
    split = split_stale(batch_3(*episodes), 1)
    assert [e.key for e in decision.batch.episodes] == [e.key for e in split.episodes]
    assert [s.key for s in decision.batch.stale] == [s.key for s in split.stale] == [episodes[0].key]


def test_a_contract_error_in_the_staleness_split_dead_letters_the_batch_as_formed():
    broken = episode(7, 1)
    broken.segments[0].rollout_token_versions = np.zeros(1, dtype=np.int64)  # not one per response token
    batch = batch_3(episode(6, 0), episode(6, 1), episode(7, 0), broken)
    decision = decided(batch, max_staleness=1)
    assert decision.verdict is Verdict.DEAD_LETTER and decision.batch is batch
    assert decision.kind == DlqKind.CONVERT and len(decision.dead_letters()) == 4
    assert decided(batch).verdict is Verdict.DEAD_LETTER  # no net: the conversion refuses it all the same
