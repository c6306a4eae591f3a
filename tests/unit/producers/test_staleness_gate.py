"""The staleness gate: batch k = group_index // G starts only under live version >= k - K, and says why it waits."""

from __future__ import annotations

import logging

import pytest

from rollout_bus.producers.staleness_gate import GateWait, StalenessGate
from rollout_bus.errors import ConfigError, Stopped
from rollout_bus.wire.run_record import RunBatching


class FakeWatcher:
    """Stands in for WeightWatcher: ``published`` are the versions the trainer publishes, one per refresh."""

    def __init__(self, version: int = 0, published: list[int] | None = None, reports_per_wait: int = 1) -> None:
        self.version = version
        self.published = list(published or [])
        self.reports_per_wait = reports_per_wait
        self.refreshes = 0
        self.waited_for: list[int] = []

    def refresh(self) -> int:
        self.refreshes += 1
        return self.version

    def wait_for(self, min_version, *, timeout_s=None, on_wait=None, stop=None):
        self.waited_for.append(min_version)
        waited = 0.0
        while self.version < min_version:
            if stop is not None and stop():
                raise Stopped(f"stopped while waiting for weights version {min_version} (live: {self.version})")
            waited += 10.0
            if on_wait is not None:
                for _ in range(self.reports_per_wait):
                    on_wait(self.version, min_version, waited)
            if not self.published:
                raise AssertionError(f"waits for version {min_version} forever (live {self.version})")
            self.version = self.published.pop(0)
        return self.version


def gate(watcher, groups_per_batch=2, max_staleness=1, **kw) -> StalenessGate:
    return StalenessGate(watcher, RunBatching(groups_per_batch, "step", max_staleness), **kw)


@pytest.mark.parametrize("groups_per_batch,max_staleness,group_index,needed", [
    (2, 1, 0, -1), (2, 1, 1, -1), (2, 1, 2, 0), (2, 1, 3, 0), (2, 1, 4, 1), (2, 1, 7, 2),
    (4, 0, 3, 0), (4, 0, 4, 1), (4, 0, 12, 3), (1, 2, 5, 3), (3, 2, 11, 1), (2, None, 1000, None),
])
def test_a_group_of_batch_k_needs_version_k_minus_max_staleness(groups_per_batch, max_staleness, group_index, needed):
    g = gate(FakeWatcher(), groups_per_batch, max_staleness)
    assert g.batch_of(group_index) == group_index // groups_per_batch
    assert g.required(group_index) == needed


def test_groups_within_the_bound_are_admitted_without_waiting():
    watcher = FakeWatcher(version=0)
    g = gate(watcher, groups_per_batch=2, max_staleness=1)
    assert [g.admit(i) for i in range(4)] == [0, 0, 0, 0]  # batches 0 and 1 need versions -1 and 0
    assert watcher.waited_for == [] and g.waits == 0 and watcher.refreshes == 4


def test_a_group_past_the_bound_waits_for_its_version_and_returns_the_live_one():
    watcher = FakeWatcher(version=0, published=[1, 3])
    g = gate(watcher, groups_per_batch=2, max_staleness=1)
    assert g.admit(4) == 1  # batch 2 needs version 1
    assert g.admit(6) == 3  # batch 3 needs 2; the trainer jumped to 3 meanwhile
    assert g.admit(8) == 3  # batch 4 needs 3: there already
    assert watcher.waited_for == [1, 2] and g.waits == 2
    assert (g.lowest, g.highest) == (0, 3)


def test_no_bound_never_waits_however_far_ahead():
    watcher = FakeWatcher(version=0)
    g = gate(watcher, groups_per_batch=1, max_staleness=None)
    assert g.admit(10_000) == 0 and watcher.waited_for == []
    assert (g.lowest, g.highest) == (0, 0)


def test_max_staleness_zero_is_synchronous_every_batch_waits_for_the_step_before_it():
    watcher = FakeWatcher(version=0, published=[1, 2, 3])
    g = gate(watcher, groups_per_batch=2, max_staleness=0)
    admitted = [g.admit(i) for i in range(8)]
    assert admitted == [0, 0, 1, 1, 2, 2, 3, 3]
    assert watcher.waited_for == [1, 2, 3]


def test_current_refreshes_without_waiting_and_tracks_the_versions_seen():
    watcher = FakeWatcher(version=2)
    g = gate(watcher)
    assert g.current() == 2
    watcher.version = 5
    assert g.current() == 5 and watcher.waited_for == []
    assert (g.lowest, g.highest) == (2, 5) and watcher.refreshes == 2


def test_the_wait_is_said_when_it_begins_each_time_the_watcher_reports_and_cleared_once_admitted(caplog):
    said: list[GateWait | None] = []
    watcher = FakeWatcher(version=2, published=[3], reports_per_wait=2)
    g = gate(watcher, groups_per_batch=4, max_staleness=1, on_wait=said.append)
    with caplog.at_level(logging.INFO, logger="rollout_bus.producers.staleness_gate"):
        assert g.admit(16) == 3  # batch 4 needs version 4 - 1
    assert said[0] == GateWait(group_index=16, batch=4, need=3, live=2, max_staleness=1, waited_s=0.0)
    assert said[0].describe() == "waiting for weights version 3 (live 2) before group 16 of batch 4, max staleness 1"
    assert [w.waited_s for w in said[1:-1]] == [10.0, 10.0] and said[-1] is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "waiting for weights version 3 (live 2) before group 16 of batch 4, max staleness 1"
    assert lines[1] == lines[0] + " (waited 10s)"
    assert lines[-1].startswith("admitted group 16 of batch 4 under weights version 3")
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_stop_ends_a_wait_and_refuses_the_next_group():
    stopping = [False]
    watcher = FakeWatcher(version=0, published=[0, 0, 0])

    def on_wait(wait):
        if wait is not None and wait.waited_s >= 20:
            stopping[0] = True  # a SIGTERM arrives while it waits

    g = gate(watcher, groups_per_batch=1, max_staleness=0, on_wait=on_wait, stop=lambda: stopping[0])
    with pytest.raises(Stopped, match="waiting for weights version 1"):
        g.admit(1)
    assert g.waits == 1
    with pytest.raises(Stopped, match="before group 0 of batch 0"):
        g.admit(0)  # even one that would not wait: stop between groups


@pytest.mark.parametrize("kw", [dict(groups_per_batch=0), dict(max_staleness=-1), dict(groups_per_batch=True)])
def test_unusable_settings_are_refused(kw):
    """The run's batching the gate is handed cannot be built with them (``RunBatching`` checks, once)."""
    with pytest.raises(ConfigError):
        gate(FakeWatcher(), **kw)
