"""The processor over batches of records: state written once per batch, and a crash at any point of a
batch's changelog loses no episode and counts none twice in its window."""

from __future__ import annotations

import asyncio
import json

import pytest

import rollout_bus.streams.turn_merge as turn_merge_module
from rollout_bus.wire.episode_record import decode_episode
from rollout_bus.streams.episode_state import EpisodeIndex, index_key
from rollout_bus.streams.processor import TurnProcessor, position_key
from rollout_bus.streams.state import ChangelogState
from rollout_bus.streams.windows import WindowEntry
from tests.unit.streams.test_episode_state import _episode, _records, _Sink
from rollout_bus.wire.topics import Topics


def _interleaved(episodes: int, turns: int) -> list:
    """Records of ``episodes`` episodes, turn by turn across episodes (as a fleet's turns arrive)."""
    per_episode = [_records(_episode(100 + e, turns)) for e in range(episodes)]
    ordered = [record for turn in range(turns) for record in (r[turn] for r in per_episode)]
    return [type(r)(r.key, r.value, r.headers, r.topic, r.partition, offset, r.timestamp_ms + offset)
            for offset, r in enumerate(ordered)]


class _Changelog:
    def __init__(self):
        self.records: list[tuple[int, bytes, bytes | None]] = []

    async def __call__(self, partition, records):
        self.records += [(partition, key, value) for key, value in records]


def _processor(store: dict, changelog=None, sink=None) -> tuple[TurnProcessor, _Sink]:
    sink = sink or _Sink()
    state = ChangelogState(store, changelog)
    return TurnProcessor(state, sink, Topics(prefix="u."), window_ms=60_000, grace_ms=0), sink


def test_a_batch_writes_each_window_entry_and_the_position_once():
    changelog = _Changelog()
    processor, sink = _processor({}, changelog)
    records = _interleaved(4, 3)
    asyncio.run(processor.handle_batch(records))
    assert len(sink.on("u.rollout.episodes")) == 4
    window_writes = [key for _, key, _ in changelog.records if key.startswith(b"w|")]
    position_writes = [key for _, key, _ in changelog.records if key == position_key(0)]
    assert len(window_writes) == 1 and len(position_writes) == 1
    (_, _, value, _), = sink.on("u.rollout.metrics")  # one open-window record for the whole batch
    assert json.loads(value)["episodes"] == 4
    assert changelog.records[-1][1] == position_key(0)  # the position is the batch's last write
    assert int(processor.table[position_key(0)]) == records[-1].offset + 1


def test_a_stored_turn_is_decoded_once_not_again_to_merge(monkeypatch):
    calls = []
    real = turn_merge_module.decode_samples
    monkeypatch.setattr(turn_merge_module, "decode_samples", lambda *a, **k: calls.append(1) or real(*a, **k))
    processor, sink = _processor({})
    asyncio.run(processor.handle_batch(_interleaved(2, 3)))
    assert len(sink.on("u.rollout.episodes")) == 2 and calls == []
    # after a restart nothing is cached: the stored payload is decoded from the state
    store = {}
    first, _ = _processor(store)
    records = _interleaved(1, 3)
    asyncio.run(first.handle_batch(records[:2]))
    second, sink = _processor(store)
    asyncio.run(second.handle_batch(records[2:]))
    assert len(sink.on("u.rollout.episodes")) == 1 and len(calls) == 2


def test_records_of_partitions_taken_away_are_left_to_their_new_owner():
    processor, sink = _processor({})
    records = _interleaved(2, 2)
    asyncio.run(processor.handle_batch(records, owned=lambda: {1}))
    assert sink.sent == [] and processor.outcomes["not_owned_skipped"] == len(records)
    assert position_key(0) not in processor.table


def _recovered(changelog: list[tuple[int, bytes, bytes | None]]) -> dict:
    store = {}
    for _, key, value in changelog:
        if value is None:
            store.pop(key, None)
        else:
            store[key] = value
    return store


@pytest.mark.parametrize("batch", [5, 64])
def test_a_crash_anywhere_in_the_changelog_loses_no_episode_and_counts_each_once(batch):
    records = _interleaved(6, 3)
    changelog = _Changelog()
    processor, _ = _processor({}, changelog)

    async def run_batches(proc, recs):
        for start in range(0, len(recs), batch):
            await proc.handle_batch(recs[start:start + batch])
    asyncio.run(run_batches(processor, records))
    keys = {r.key for r in records}
    for cut in range(len(changelog.records) + 1):
        store = _recovered(changelog.records[:cut])  # what the changelog held when the worker died
        replayed, sink = _processor(store)
        asyncio.run(run_batches(replayed, records))  # the new owner reads from the committed offset: all of it
        assert all(EpisodeIndex.from_bytes(store[index_key(k)]).finished for k in keys), cut
        assert not any(key.startswith(b"t|") for key in store), cut  # no stored turn left behind
        window = json.loads(sink.on("u.rollout.metrics")[-1][2]) if sink.on("u.rollout.metrics") else None
        entry = [v for k, v in store.items() if k.startswith(b"w|")]
        assert len(entry) == 1 and WindowEntry.from_bytes(entry[0]).stats.episodes == 6, cut
        if window is not None:
            assert window["episodes"] == 6, cut
        emitted_before = {k for k in keys if index_key(k) in _recovered(changelog.records[:cut])
                          and EpisodeIndex.from_bytes(_recovered(changelog.records[:cut])[index_key(k)]).finished}
        emitted_now = {key for _, key, _, _ in sink.on("u.rollout.episodes")}
        assert emitted_before | emitted_now == keys, cut
        assert all(decode_episode(v)[1].turns == 3 for _, _, v, _ in sink.on("u.rollout.episodes"))
