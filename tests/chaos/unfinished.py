"""Judging a run whose generator was killed for good and closed with ``rollout-bus end-run``.

Why: such a generator writes no summary, so what it sent is read from rollout.turns
(``evidence.logged_episodes``). An episode with a final turn there must be in exactly one batch or the DLQ
(the ordinary reconciliation, against those episodes); one with turns and no final turn will never be
finished: it must be in the DLQ as ``unfinished`` only, in no batch. A group some of whose members never
sent a turn can only be written short, and the reconciliation must name exactly those groups
(``incomplete_groups``). A run with no episode in flight at the kill proves nothing and fails.
"""

from __future__ import annotations

import re
from collections import defaultdict

from rollout_bus.observe.accounting import Reconciliation
from rollout_bus.wire.dead_letter import DlqKind
from tests.chaos.harness import RunFacts


def unfinished_problems(rec: Reconciliation, facts: RunFacts, limit: int = 5) -> list[str]:
    """What is wrong with the in-flight episodes and the short groups; a note says what was seen."""
    logged = facts.logged
    if logged is None:
        return ["rollout.turns was never read: the run was not closed with end-run"]
    kinds: dict[str, set[str]] = defaultdict(set)
    for letter in facts.dead_letters:
        if letter.key:
            kinds[letter.key.decode(errors="replace")].add(letter.kind)
    problems = []
    if not logged.unfinished:
        problems.append("no episode was in flight when the generator was killed: nothing was tested")
    undead = sorted(k for k in logged.unfinished if kinds.get(k) != {DlqKind.UNFINISHED})
    if undead:
        problems.append(f"{len(undead)} episodes with turns and no final turn not dead-lettered as unfinished "
                        f"(only), e.g. {[(k, sorted(kinds.get(k, ()))) for k in undead[:limit]]}")
    written = sorted(logged.unfinished & set(rec.unexpected))
    if written:
        problems.append(f"{len(written)} unfinished episodes written to a batch, e.g. {written[:limit]}")
    reported = {int(g) for g in re.findall(r"group_index=(\d+)", " ".join(rec.incomplete_groups))}
    if reported != logged.short_groups:
        problems.append(f"incomplete groups reported {sorted(reported)}, expected the groups with members that "
                        f"sent no turn {sorted(logged.short_groups)}")
    facts.notes.append(f"{len(logged.finished)} finished episodes in the log, {len(logged.unfinished)} in flight "
                       f"dead-lettered unfinished; {len(rec.incomplete_groups)} incomplete groups reported")
    return problems
