"""A generator following the trainer whose published checkpoint is missing or fails its sha256: it says so, waits a
bounded time for a newer version with no verified weights, and with weights it has goes on under its staleness bound.

Proven here, on the CPU with real checkpoints and no broker (a fake clock that the poll of rollout.weights moves
on, never a real wait): ``wait_for_first_weights`` with ``give_up_s`` ends in ``NoUsableWeights`` naming
``version 0 at URI: sha256 mismatch`` / ``missing`` and that none was loaded, ``give_up_s`` after the refusal,
saying WARNING lines meanwhile; a newer, good version inside the wait is loaded; nothing published is no error
(it waits on, as for a trainer not started yet), and no ``give_up_s`` waits for ever. ``LoadedVersions``: the
staleness gate counts the version the engine runs, so a refused newer version neither admits a group it would
be too stale for nor stops the generator: it waits for a version past the refused one, telling the version in use.
"""

from __future__ import annotations

import hashlib
import logging

import pytest

import rollout_bus.learn.generator as generator_module
from rollout_bus.errors import NoUsableWeights, Stopped
from rollout_bus.learn.engine import PolicyEngine
from rollout_bus.learn.generator import LoadedVersions, wait_for_first_weights
from rollout_bus.policy.checkpoint import CheckpointRef, save_checkpoint
from rollout_bus.policy.model import build_policy
from rollout_bus.policy.sampler import Sampler
from rollout_bus.producers.staleness_gate import StalenessGate
from rollout_bus.wire.run_record import RunBatching
from rollout_bus.wire.weight_version import WeightVersion

SEED = 5
POLL_S = 0.2  # what one poll of rollout.weights moves the fake clock on


def _record(ref: CheckpointRef, sha256: str | None = None) -> WeightVersion:
    return WeightVersion(ref.version, ref.step, 1_700_000_000_000, f"file://{ref.path}", sha256 or ref.sha256,
                         ref.bytes)


class Clock:
    """A fake monotonic clock; ``poll(ms)`` stands for ``watcher.refresh(timeout_ms=ms)`` and moves it on."""

    def __init__(self) -> None:
        self.now, self.polls = 1000.0, 0

    def __call__(self) -> float:
        return self.now

    def poll(self, _timeout_ms: int) -> None:
        self.polls += 1
        self.now += POLL_S


def _engine(live) -> PolicyEngine:
    return PolicyEngine(SEED, Sampler(1.0, 0.9, 20), live=live, device="cpu")


@pytest.fixture()
def v0(tmp_path) -> CheckpointRef:
    return save_checkpoint(build_policy(SEED), tmp_path, version=0, step=0)


def _corrupted(ref: CheckpointRef) -> WeightVersion:
    data = bytearray(ref.path.read_bytes())
    data[len(data) // 2] ^= 0x10
    ref.path.write_bytes(bytes(data))
    return _record(ref)


def _deleted(ref: CheckpointRef) -> WeightVersion:
    ref.path.unlink()
    return _record(ref)


@pytest.mark.parametrize("spoil, problem", [(_corrupted, "sha256 mismatch ("), (_deleted, "missing")],
                         ids=["sha256-mismatch", "missing"])
def test_a_refused_first_version_ends_the_wait_after_give_up_s_naming_it(v0, spoil, problem, caplog):
    record, clock = spoil(v0), Clock()
    engine = _engine(lambda: record)
    with caplog.at_level(logging.INFO, logger=generator_module.__name__):
        with pytest.raises(NoUsableWeights) as gave_up:
            wait_for_first_weights(engine, clock.poll, say_every_s=1.0, give_up_s=3.0, clock=clock)
    text = str(gave_up.value)
    assert f"version 0 at {record.uri}: {problem}" in text, text
    assert "no published weights loaded yet" in text and "--weights-wait-s" in text, text
    assert text.startswith("no usable weights after waiting 3s: "), text
    assert clock.polls == pytest.approx(3.0 / POLL_S, abs=1)  # the bound, not a poll more or a poll less
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) >= 2 and all(f"version 0 at {record.uri}: {problem}" in w for w in warnings), warnings
    assert "giving up in" in warnings[0]
    assert engine.loaded is None and len(engine.refused) == 1


def test_a_newer_good_version_inside_the_wait_is_loaded(v0, tmp_path):
    bad = _record(v0, sha256=hashlib.sha256(b"a torn copy").hexdigest())
    good = _record(save_checkpoint(build_policy(SEED), tmp_path / "next", version=1, step=1))
    clock = Clock()
    engine = _engine(lambda: good if clock.polls >= 10 else bad)
    assert wait_for_first_weights(engine, clock.poll, give_up_s=3.0, clock=clock) == 1
    assert engine.loaded == (1, good.sha256) and list(engine.refused) == [(0, bad.sha256)]


@pytest.mark.parametrize("give_up_s", [None, 0.0])
def test_without_a_bound_or_with_nothing_published_the_wait_goes_on(v0, give_up_s):
    bad = _record(v0, sha256=hashlib.sha256(b"a torn copy").hexdigest())
    clock = Clock()
    with pytest.raises(Stopped):  # far past any bound: only the stop ends it
        wait_for_first_weights(_engine(lambda: bad), clock.poll, give_up_s=give_up_s, clock=clock,
                               stop=lambda: clock.polls >= 2000)
    clock = Clock()
    with pytest.raises(Stopped):  # nothing published: a trainer not started yet is no error
        wait_for_first_weights(_engine(lambda: None), clock.poll, give_up_s=3.0, clock=clock,
                               stop=lambda: clock.polls >= 2000)


class FakeWatcher:
    """rollout.weights as a ``WeightWatcher`` shows it: ``latest``; ``wait_for`` publishes what ``then`` gives
    for the version waited for (and records the calls)."""

    def __init__(self, latest: WeightVersion, then) -> None:
        self.latest, self.then, self.waits = latest, then, []

    @property
    def version(self) -> int:
        return self.latest.version

    def refresh(self, timeout_ms: int = 0) -> int:
        return self.version

    def wait_for(self, min_version, *, timeout_s=None, on_wait=None, stop=None) -> int:
        self.waits.append(min_version)
        if on_wait is not None:
            on_wait(self.version, min_version, 12.0)
        if stop is not None and stop():
            raise Stopped(f"stopped while waiting for weights version {min_version}")
        self.latest = self.then(min_version)
        return self.version


def test_the_gate_counts_the_version_the_engine_runs_and_waits_past_a_refused_one(tmp_path, caplog):
    refs = {v: save_checkpoint(build_policy(SEED), tmp_path / str(v), version=v, step=v) for v in (1, 3)}
    refused = WeightVersion(2, 2, 0, f"file://{tmp_path}/gone.safetensors", hashlib.sha256(b"x").hexdigest(), 1)
    watcher = FakeWatcher(_record(refs[1]), then=lambda need: _record(refs[3]))
    engine = _engine(lambda: watcher.latest)
    assert engine.refresh() == 1
    watcher.latest = refused  # the trainer publishes version 2; its file is not there
    told = []
    gate = StalenessGate(LoadedVersions(watcher, engine), RunBatching(1, "step", 0),
                         on_wait=lambda wait: told.append(None if wait is None else (wait.need, wait.live)))
    with caplog.at_level(logging.ERROR):
        assert gate.admit(1) == 1  # batch 1 needs version 1: the one it runs, though 2 is published
        assert gate.admit(1) == 1  # ... asked again: the refusal is not said again
        assert gate.admit(2) == 3  # batch 2 needs 2: 2 was refused, so it waits for a newer one (3)
    assert watcher.waits == [3] and engine.version == 3
    assert told == [(2, 1), (2, 1), None]  # the version in use, told while it waits
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"weights version 2 at {refused.uri}: missing, refused; still using version 1"]
    stopping = FakeWatcher(refused, then=lambda need: refused)
    engine = _engine(lambda: stopping.latest)
    engine.version, engine.loaded = 1, (1, "x")  # verified weights of version 1
    gate = StalenessGate(LoadedVersions(stopping, engine), RunBatching(1, "step", 0), stop=lambda: bool(stopping.waits))
    with pytest.raises(Stopped):  # with weights it has, only a stop ends the wait: never NoUsableWeights
        gate.admit(2)
