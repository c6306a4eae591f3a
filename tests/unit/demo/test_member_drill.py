"""`demo --kill-members`: which member the drill kills, and what a run with a killed member counts as sent."""

from __future__ import annotations

from types import SimpleNamespace

from typer.testing import CliRunner

from rollout_bus.cli.main import app
from rollout_bus.demo.prompts_run import part_way_holder, logged_finals
from rollout_bus.wire.headers import TurnHeaders
from rollout_bus.wire.prompt_record import LedgerEvent, PromptLedger, TurnMark


def _ledger(*events: LedgerEvent) -> PromptLedger:
    ledger = PromptLedger()
    for event in events:
        ledger.take(event)
    return ledger


def _progress(prompt: str, member: str, sample: int, turn: int, final: bool) -> LedgerEvent:
    return LedgerEvent("progress", prompt, 1, member, mark=TurnMark(sample, 0, turn, final, False, 0, turn))


def test_the_drill_picks_a_member_holding_a_group_with_turns_of_an_unfinished_episode_on_the_log():
    ledger = _ledger(LedgerEvent("claimed", "p-done", 1, "g0"), _progress("p-done", "g0", 0, 0, True),
                     LedgerEvent("done", "p-done", 1, "g0"),
                     LedgerEvent("claimed", "p-whole", 1, "g0"), _progress("p-whole", "g0", 0, 0, True),
                     LedgerEvent("claimed", "p-none", 1, "g1"),
                     LedgerEvent("claimed", "p-mid", 1, "g1"), _progress("p-mid", "g1", 0, 0, True),
                     _progress("p-mid", "g1", 1, 0, False), _progress("p-mid", "g1", 1, 1, False))
    # p-done ended, p-whole's one episode finished, p-none has nothing logged: only p-mid is part-way
    assert part_way_holder(ledger, ["g0", "g1"]) == ("g1", "p-mid", 2)
    assert part_way_holder(ledger, ["g0"]) is None  # a member no longer live (killed before) is never picked


def _record(key: str | None, attempt: int, final: bool, headers=None):
    turn = TurnHeaders(turn=0, attempt=attempt, final=final, group_size=2, sent_at_ms=1).to_kafka()
    return SimpleNamespace(key=key.encode() if key else None, headers=turn if headers is None else headers)


def test_a_killed_members_episodes_are_those_with_a_final_turn_on_the_log_at_their_last_attempt():
    records = [_record("a", 0, False), _record("a", 0, True), _record("b", 0, True), _record("b", 1, True),
               _record("c", 0, False), _record("d", 0, True, headers=[("turn", b"x")]),
               _record("e", 0, True, headers=[("control", b"end-of-run")])]
    assert logged_finals(records) == [("a", 0), ("b", 1)]  # c unfinished; d not a turn; the control record skipped


def test_kill_members_is_refused_without_from_prompts():
    done = CliRunner().invoke(app, ["demo", "--kill-members", "1", "--bootstrap-servers", "127.0.0.1:9"])
    assert done.exit_code == 2 and "--kill-members is for --from-prompts" in " ".join(done.output.split())
