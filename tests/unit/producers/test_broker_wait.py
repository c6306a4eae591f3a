"""Saying so while records wait for the broker: one WARNING per interval, the progress line told, then quiet."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rollout_bus.producers.broker_wait import BrokerWaitWatch, PendingRecords


@pytest.fixture
def watch():
    seen: list = []
    pending = PendingRecords()
    w = BrokerWaitWatch(pending, "t.rollout.turns", on_wait=seen.append, interval_s=10.0, thread=False)
    w.seen = seen
    yield w
    w.close()


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_pending_records_unanswered_for_an_interval_log_one_warning_per_interval(watch, caplog):
    caplog.set_level(logging.INFO, logger="rollout_bus.producers.broker_wait")
    watch.pending.sent(2_000_000)
    watch.pending.sent(500_000)
    t0 = watch.pending.last_answer
    watch.check(t0 + 5)
    assert warnings(caplog) == [] and watch.seen == []
    # 10.25 s, not 10.5: the line rounds the seconds (".0f"), and t0 + 10.5 - t0 on a large monotonic clock is
    # 10.5 give or take an ulp, so it printed 10 or 11 by the clock's value (seen once in CI)
    watch.check(t0 + 10.25)
    watch.check(t0 + 15)  # within the same interval: no second line
    watch.check(t0 + 21)
    lines = warnings(caplog)
    assert len(lines) == 2 and "waiting for broker" in lines[0] and "topic=t.rollout.turns" in lines[0]
    assert "2 records (2.5 MB) unacknowledged, none answered for 10s" in lines[0]
    assert [w.records for w in watch.seen] == [2, 2] and watch.seen[1].waited_s == pytest.approx(21)


def test_an_answer_ends_the_wait_with_one_info_line_and_clears_the_progress_note(watch, caplog):
    caplog.set_level(logging.INFO, logger="rollout_bus.producers.broker_wait")
    watch.pending.sent(100)
    watch.pending.sent(100)
    watch.check(watch.pending.last_answer + 11)
    watch.pending.settled(100)
    watch.check(watch.pending.last_answer + 1)
    assert watch.seen[-1] is None
    assert any("broker answering again" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    watch.check(watch.pending.last_answer + 2)
    assert len(watch.seen) == 2  # nothing more to say


def test_a_flush_the_broker_keeps_answering_is_not_a_wait(watch, caplog):
    watch.pending.sent(100)
    watch.pending.sent(100)
    with watch.pending.blocked("flush"):
        began = time.monotonic()
        watch.pending.settled(100)  # answered just now
        watch.check(began + 5)
        assert watch.seen == []
        watch.check(watch.pending.last_answer + 12)
    assert watch.seen and watch.seen[0].blocked_in == "flush" and "blocked in flush" in warnings(caplog)[0]


def test_a_caller_blocked_with_nothing_pending_is_a_wait(watch, caplog):
    with watch.pending.blocked("send"):
        watch.check(time.monotonic() + 11)
    assert watch.seen and watch.seen[0].records == 0 and watch.seen[0].blocked_in == "send"
    assert "none answered for 1" in warnings(caplog)[0]


def test_a_full_buffer_blocks_the_sender_until_the_broker_answers():
    pending = PendingRecords()
    pending.sent(600)
    pending.sent(300)
    released = threading.Event()

    def send() -> None:
        pending.wait_for_room(200, limit=1000)
        released.set()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    assert not released.wait(0.3)
    pending.settled(300)
    assert released.wait(5)
    pending.settled(600)
    pending.wait_for_room(5000, limit=1000)  # alone a record may exceed the limit: no wait
    thread.join(5)


def test_a_failing_progress_callback_never_reaches_the_producer(caplog):
    def broken(_wait):
        raise RuntimeError("display gone")

    pending = PendingRecords()
    watch = BrokerWaitWatch(pending, "t", on_wait=broken, interval_s=10.0, thread=False)
    try:
        pending.sent(1)
        watch.check(pending.last_answer + 11)
    finally:
        watch.close()
    assert any("on_wait callback failed" in r.getMessage() for r in caplog.records)
